"""The roofline's FLOP formulas against torch's own counter, and `eyas bench synth` end to end."""

from __future__ import annotations

import json

import pytest
import torch


def _counted(target, length: int, **kw) -> float:
    from transformers import AutoModelForCausalLM

    from eyas.bench.roofline import count_flops

    # eager attention and experts: torch's counter does not count transformers' grouped-mm experts kernel
    m = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32, attn_implementation="eager",
                                             experts_implementation="eager").eval()
    ids = torch.randint(0, 1000, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return count_flops(lambda: m(input_ids=ids, use_cache=False, **kw))


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_moe"])
def test_target_flops_equal_torchs_count_of_an_hf_forward(arch, request):
    """Eager attention scores every key (no causal skip): a forward over T tokens is T tokens attending to
    T keys each; with logits for every token or for the last only. The MoE's routed experts, shared
    experts and router are counted as the forward runs them."""
    from eyas.bench.roofline import target_flops
    from eyas.target import text_config

    target = request.getfixturevalue(arch)
    tc = text_config(target)
    T = 48
    assert _counted(target, T) == pytest.approx(T * target_flops(tc, T, logits=True), rel=1e-6)
    head = target_flops(tc, 0, True) - target_flops(tc, 0, False)
    assert _counted(target, T, logits_to_keep=1) == pytest.approx(T * target_flops(tc, T, logits=False) + head, rel=1e-6)


def test_conversation_flops_add_up_turn_by_turn(tiny_llama):
    """A turn prefills its prompt (the last prompt token's logits give the first reply token) and decodes
    the other reply tokens, each attending to its whole context, itself included; turn 2's prefill covers
    only what turn 1 did not leave in the cache (its reply's last token was never fed back)."""
    from eyas.bench.roofline import prefill_flops, target_flops
    from eyas.bench.synth import conversation_flops
    from eyas.target import text_config

    tc = text_config(tiny_llama)
    head = target_flops(tc, 0, True) - target_flops(tc, 0, False)
    pre, dec = conversation_flops(tc, [10], [4])
    assert pre == pytest.approx(prefill_flops(tc, 10) + head)
    assert dec == pytest.approx(sum(target_flops(tc, 10 + j + 1, True) for j in range(3)))
    pre2, dec2 = conversation_flops(tc, [10, 20], [4, 3])
    per_key = target_flops(tc, 1, False) - target_flops(tc, 0, False)
    new = 20 - 13  # turn 2 adds 7 tokens to the 13 the cache holds
    assert pre2 - pre == pytest.approx(new * target_flops(tc, 0, False) + per_key * (new * 13 + new * (new + 1) / 2) + head)
    assert dec2 - dec == pytest.approx(sum(target_flops(tc, 20 + j + 1, True) for j in range(2)))


def test_peak_flops_measures_a_matmul():
    from eyas.bench.roofline import count_flops, peak_flops

    p = peak_flops("float32", 1, sizes=(256,), seconds=0.05)
    assert p["flops"] > 1e8 and p["threads"] == 1 and p["n"] == 256 and p["dtype"] == "float32"
    a = torch.randn(8, 16)
    assert count_flops(lambda: a @ torch.randn(16, 4)) == 2 * 8 * 16 * 4


@pytest.mark.slow
def test_bench_synth_runs_each_row_as_eyas_synth(vllm_target, tmp_path):
    """Two rows (the recipe, and a concurrency override), one repeat: each an `eyas synth` run on the same
    conversations, read back from its manifest, with its FLOPs and share of the measured peak."""
    from eyas.bench.synth import bench_synth
    from eyas.config import load_recipe

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "domain": "chat", "messages": [
        {"role": "user", "content": f"Count to {i}."}, {"role": "assistant", "content": "x"},
        {"role": "user", "content": "Again."}]}) + "\n" for i in range(6)))
    cfg = load_recipe("demo", [f"run.target={vllm_target}", "synth.max_tokens=8", "synth.max_model_len=256"])
    res = bench_synth(cfg, vllm_target, prompts, ["c2: synth.concurrency=2"], tmp_path / "b", limit=4, repeats=1)
    rows = res["rows"]
    assert list(rows) == ["recipe", "c2"] and rows["recipe"]["ratio"] == 1.0
    for row in rows.values():
        (rd,) = row["readings"]
        assert rd["requests"] == 8 and rd["completion_tokens"] == 64  # 4 conversations x 2 turns x 8 tokens
        assert rd["prefill_flops"] > 0 and rd["decode_flops"] > 0 and 0 < row["fraction_of_peak"] < 1
    assert json.loads((tmp_path / "b" / "c2" / "synth" / "manifest.json").read_text())["config"]["concurrency"] == 2
    with pytest.raises(ValueError, match="only synth"):
        bench_synth(cfg, vllm_target, prompts, ["bad: train.lr=1"], tmp_path / "c", limit=1, repeats=1)
