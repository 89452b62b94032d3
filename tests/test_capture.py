"""synth.capture: hidden states kept while the target writes, adopted by the extract stage (fast: HF states
stand in for the engine's), and vLLM's own captured states against HF fp32 (slow)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eyas.config import ExtractConfig
from tests.test_extract import CONVS, check_parity, hf_reference, print_errors, tok_err


def test_fill_prefix_takes_cached_positions_from_the_turn_before():
    from eyas.synth.capture import fill_prefix

    states = torch.arange(6 * 2 * 3, dtype=torch.float32).view(6, 2, 3)
    seen = torch.ones(6, dtype=torch.bool)
    assert fill_prefix([1, 2, 3, 4, 5, 6], states, seen, None) is states  # nothing missing
    seen[:3] = False
    cut = states.clone()
    cut[:3] = 0
    assert fill_prefix([1, 2, 3, 4, 5, 6], cut, seen, None) is None  # missing, nothing to take them from
    prev = ([1, 2, 3, 4], states[:4] + 0)
    assert torch.equal(fill_prefix([1, 2, 3, 4, 5, 6], cut, seen, prev), states)
    assert fill_prefix([1, 2, 9, 4, 5, 6], cut, seen, prev) is None  # the turn before had other tokens there
    assert fill_prefix([1, 2, 3, 4, 5, 6], cut, seen, ([1, 2], states[:2])) is None  # too short


def test_capture_needs_vllm_in_this_process_run_eagerly():
    from eyas.config import SynthConfig
    from eyas.synth import captures

    assert captures(SynthConfig(capture=True)) and not captures(SynthConfig())
    for off in ({"endpoint": ["http://127.0.0.1:8000"]}, {"serve": True}, {"engine": "hf"}, {"enforce_eager": False}):
        assert not captures(SynthConfig(capture=True, **off)), off


def _engine_states(target: Path, ids: list[int], vllm_ids: list[int]) -> torch.Tensor:
    """What the engine hands back for `ids`: vLLM ids k < L = HF hidden_states[k], L = layer L's raw output."""
    hs, pre, *_ = hf_reference(target, torch.tensor(ids))
    L = len(hs) - 1
    return torch.stack([pre if k == L else hs[k] for k in vllm_ids], 1)  # [T, n_ids, H]


def _extract_edited(tmp_path: Path, target: Path, synth: Path, convs: list[dict], edit: int, reply: str):
    """Conversation `edit`'s last reply replaced by `reply` after synthesis; the conversations extracted beside
    SYNTH/captured and, for reference, from a dir without it. -> (the features' manifest, {id: sample}, {id: ref})."""
    from eyas.extract import extract
    from eyas.features import open_features

    changed = json.loads(json.dumps(convs))
    changed[edit]["messages"][-1]["content"] = reply
    (synth / "conversations.jsonl").write_text("".join(json.dumps(c) + "\n" for c in changed))
    cfg = ExtractConfig(target=str(target), data=str(synth / "conversations.jsonl"), out=str(tmp_path / "feat"),
                        backend="hf", compute_dtype="fp32", layer_ids=[1, 2, 3])
    extract(cfg)
    (tmp_path / "plain").mkdir()
    ref_cfg = ExtractConfig(**{**cfg.__dict__, "data": str(tmp_path / "plain" / "c.jsonl"), "out": str(tmp_path / "ref")})
    (tmp_path / "plain" / "c.jsonl").write_text((synth / "conversations.jsonl").read_text())
    extract(ref_cfg)
    ref = open_features(ref_cfg.out)
    assert ref.manifest["captured_last_run"] == 0
    ds = open_features(cfg.out)
    return ds.manifest, {s["id"]: s for s in ds}, {s["id"]: s for s in ref}


def test_extract_takes_captured_conversations_and_runs_the_rest(tmp_path, tiny_llama):
    """Conversation a: captured and taken as is; b: captured, then its reply changed (a re-run's other sample):
    run through the target; c: not captured (a prefix vLLM cached from another conversation): run too."""
    from eyas.chat import load_chat_template, load_tokenizer
    from eyas.extract import Renderer
    from eyas.features import CAPTURE_SLACK as SLACK
    from eyas.synth.capture import CaptureWriter

    synth = tmp_path / "synth"
    synth.mkdir()
    convs = [CONVS[0], CONVS[1], {**CONVS[0], "id": "c"}]
    tok, template = load_tokenizer(tiny_llama), load_chat_template(tiny_llama)
    capw = CaptureWriter(synth, tiny_llama, tok, template, 2048, [1, 2, 3], "sha", "fp32")
    assert capw.vllm_ids == [1, 2, 3, 4]  # + L = 4, the pre-norm final state
    renderer = Renderer(tiny_llama, "", 2048)
    for conv in convs[:2]:
        full = renderer.render(conv)["input_ids"].tolist()
        ids = full[:-2]  # the engine never ran the reply's last token (<|im_end|>) nor the template's newline
        capw.add(conv["id"], conv["messages"], (ids, _engine_states(tiny_llama, ids, capw.vllm_ids)))
    capw.add("c", convs[2]["messages"], None)
    capw.add("d", [], None)  # nothing generated: not counted
    assert (capw.kept, capw.left) == (2, 1)
    capw.finish()

    man, got, ref = _extract_edited(tmp_path, tiny_llama, synth, convs, 1, "You are very welcome.")
    assert man["captured_last_run"] == 1 and sorted(got) == ["a", "b", "c"]
    # against the same conversations run through the target: a's captured sample is theirs, short of its last SLACK
    a, ra = got["a"], ref["a"]
    T = a["input_ids"].shape[0]
    assert ra["input_ids"].shape[0] - SLACK <= T < ra["input_ids"].shape[0]
    assert torch.equal(a["input_ids"], ra["input_ids"][:T]) and torch.equal(a["loss_mask"], ra["loss_mask"][:T])
    assert tok_err(a["aux_hidden_states"], ra["aux_hidden_states"][:T]) < 1e-2
    assert tok_err(a["last_hidden_states"], ra["last_hidden_states"][:T]) < 1e-2
    for cid in ("b", "c"):  # run through the target: whole
        assert torch.equal(got[cid]["input_ids"], ref[cid]["input_ids"])
        assert torch.equal(got[cid]["aux_hidden_states"], ref[cid]["aux_hidden_states"])


def test_a_reply_that_re_renders_otherwise_is_kept_as_the_engine_generated_it(tmp_path, tiny_llama):
    """The engine's last-reply tokens part from the render inside that reply (non-canonical tokenization):
    synthesis keeps the engine's tokens and states and lists the conversation in as_generated.jsonl; the
    extract stage takes that sample as is while the conversation renders as it did, and runs it through the
    target once it was edited; tokens parting before the last reply leave the conversation to the target."""
    from eyas.chat import load_chat_template, load_tokenizer
    from eyas.extract import Renderer
    from eyas.features import CAPTURE_AS_GENERATED, CAPTURED
    from eyas.synth.capture import CaptureWriter

    synth = tmp_path / "synth"
    synth.mkdir()
    convs = [CONVS[0], {**CONVS[0], "id": "edited"}, {**CONVS[1], "id": "early"}]
    tok, template = load_tokenizer(tiny_llama), load_chat_template(tiny_llama)
    capw = CaptureWriter(synth, tiny_llama, tok, template, 2048, [1, 2, 3], "sha", "fp32")
    renderer = Renderer(tiny_llama, "", 2048)
    engine = {}
    for conv in convs:
        r = renderer.render(conv)
        full = r["input_ids"].tolist()
        m = r["loss_mask"].tolist()
        last = max(i for i in range(1, len(m)) if m[i] and not m[i - 1])  # the last reply's first token
        k = last + 2 if conv["id"] != "early" else last - 1
        # the engine wrote the reply's tokens k, k+1 as one other token, then the rest as rendered
        engine[conv["id"]] = ids = full[:k] + [(full[k] + 1) % 100] + full[k + 2 : -2]
        capw.add(conv["id"], conv["messages"], (ids, _engine_states(tiny_llama, ids, capw.vllm_ids)))
    assert (capw.kept, capw.left, capw.as_generated) == (2, 1, 2)
    man = capw.finish()
    assert man["as_generated_last_run"] == 2 and man["left_to_extract_last_run"] == 1
    listed = (synth / CAPTURED / CAPTURE_AS_GENERATED).read_text().splitlines()
    assert [json.loads(x)["id"] for x in listed] == ["a", "edited"]

    man, got, ref = _extract_edited(tmp_path, tiny_llama, synth, convs, 1, "Another reply, written after synthesis.")
    assert man["captured_last_run"] == 1 and man["captured_as_generated_last_run"] == 1
    a, ra = got["a"], ref["a"]
    assert a["input_ids"].tolist() == engine["a"]
    k = next(i for i, (x, y) in enumerate(zip(engine["a"], ra["input_ids"].tolist())) if x != y)
    assert a["loss_mask"].tolist() == ra["loss_mask"][:k].tolist() + [True] * (len(engine["a"]) - k)
    want = _engine_states(tiny_llama, engine["a"], capw.vllm_ids)  # the target's states on the engine's tokens
    assert tok_err(a["aux_hidden_states"], want[:, :3]) < 1e-2
    for cid in ("edited", "early"):  # run through the target: the render
        assert torch.equal(got[cid]["input_ids"], ref[cid]["input_ids"])
        assert torch.equal(got[cid]["aux_hidden_states"], ref[cid]["aux_hidden_states"])


def test_captured_with_other_layers_is_not_used(tmp_path, tiny_llama, capsys):
    from eyas.chat import load_chat_template, load_tokenizer
    from eyas.extract import Renderer, extract
    from eyas.features import open_features
    from eyas.synth.capture import CaptureWriter

    synth = tmp_path / "synth"
    synth.mkdir()
    capw = CaptureWriter(synth, tiny_llama, load_tokenizer(tiny_llama), load_chat_template(tiny_llama), 2048, [1, 3],
                         "sha", "fp32")
    ids = Renderer(tiny_llama, "", 2048).render(CONVS[0])["input_ids"].tolist()[:-2]
    capw.add("a", CONVS[0]["messages"], (ids, _engine_states(tiny_llama, ids, capw.vllm_ids)))
    capw.finish()
    (synth / "conversations.jsonl").write_text(json.dumps(CONVS[0]) + "\n")
    cfg = ExtractConfig(target=str(tiny_llama), data=str(synth / "conversations.jsonl"), out=str(tmp_path / "feat"),
                        backend="hf", layer_ids=[1, 2, 3])
    extract(cfg)
    assert open_features(cfg.out).manifest["captured_last_run"] == 0
    assert "captured with another layer_ids: not used" in capsys.readouterr().err


# ---------------------------------------------------------------- slow: vLLM

# a first turn longer than vLLM CPU's 128-token block: the second turn's prompt is served in part from the
# prefix cache, so its captured states must be filled from the first turn's
LONG = ("The falconer keeps the young hawk on the glove for days before its first flight, and speaks to it so that "
        "it knows the voice that calls it back. ") * 6
ROWS = [
    {"id": "one", "domain": "general", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"id": "multi", "domain": "chat", "messages": [
        {"role": "user", "content": LONG + " Who are you? Tell me about yourself in a few sentences."},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "Now tell me a joke about hawks."}]},
    {"id": "code", "domain": "code", "messages": [{"role": "user", "content": "Write a Python function that adds."}]},
]


@pytest.mark.slow
def test_vllm_captured_states_equal_hf_and_extract_takes_them(tmp_path, embedded_target):
    """`eyas synth --capture` on the embedded target (a multi-turn conversation whose second turn vLLM serves
    partly from its prefix cache): every conversation captured, adopted by the extract stage, and its states
    HF fp32's within the engine dtype's tolerance (the storage is bf16)."""
    from eyas.extract import extract
    from eyas.features import open_features
    from eyas.host import engine_dtype

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "synth"
    p = subprocess.run([sys.executable, "-m", "eyas", "synth", "--target", str(embedded_target), "--prompts",
                        str(prompts), "--out", str(out), "--max-tokens", "48", "--concurrency", "4",
                        "--kv-cache-gib", "1", "--capture"], capture_output=True, text=True, timeout=900,
                       env={**os.environ})
    assert p.returncode == 0, p.stderr[-3000:]
    man = json.loads((out / "manifest.json").read_text())
    assert man["last_run"]["captured"] == {"kept": 3, "left_to_extract": 0, "prefix_filled_turns": 1,
                                             "as_generated": 0}, man["last_run"]
    cfg = ExtractConfig(target=str(embedded_target), data=str(out / "conversations.jsonl"), out=str(tmp_path / "f"),
                        backend="hf")
    extract(cfg)
    ds = open_features(cfg.out)
    assert ds.manifest["captured_last_run"] == 3
    samples = list(ds)
    assert any(s["id"] == "multi" and int(s["loss_mask"].sum()) > 0 for s in samples)
    fp32 = engine_dtype() == "float32"
    check_parity("vllm capture", embedded_target, samples, ds.layer_ids, tol=0.01 if fp32 else 0.06,
                 last_tol=0.01 if fp32 else 0.06)
    print_errors(f"vLLM captured states ({engine_dtype()}) vs HF fp32 hidden_states[k]")
