"""The seed's target architectures on this machine (eyas.testing.ARCHS, tiny random versions): each
through vLLM CPU against an independent transformers float32 forward, then train -> export -> serve
the draft under vLLM speculative decoding; and the CPU-only vLLM defects eyas works around
(eyas.vllm_fixes), each pinned both ways: still there without the workaround (so a fixed vLLM shows
up and the workaround can go), and gone with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eyas.config import ExtractConfig, TrainConfig
from eyas.testing import make_tiny_target
from eyas.vllm_fixes import ENV_LM_ONLY, DraftNotServable, draft_limit, engine_options

ARCHS = ["qwen3", "gpt_oss", "deepseek_v3", "minimax_m2", "kimi_k25"]  # llama, qwen3_moe: tests/test_extract.py
CONVS = [
    {"id": "a", "domain": "test", "messages": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6, of course."}]},
    {"id": "b", "domain": "test", "messages": [
        {"role": "user", "content": "Name the colour of a clear daytime sky and say why."},
        {"role": "assistant", "content": "Blue: air scatters short wavelengths (Rayleigh scattering) the most."},
        {"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "You're welcome."}]},
]
LAYER_IDS = [1, 2, 3]


def hf_states(target: Path, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """HF hidden_states [L+1] of [T, H] from transformers' own class of the whole checkpoint, float32
    (a multimodal wrapper through its own model class and language model: independent of eyas's loader)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    cfg = AutoConfig.from_pretrained(target)
    if "text_config" in cfg.to_dict():
        # the released names (`language_model.model.*`) are what transformers' own conversion reads
        model = AutoModelForImageTextToText.from_pretrained(target, dtype=torch.float32).eval()
        lm = model.model.language_model
        with torch.no_grad():
            out = lm(input_ids=input_ids[None], output_hidden_states=True)
    else:
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        with torch.no_grad():
            out = model.model(input_ids=input_ids[None], output_hidden_states=True)
    return [h[0] for h in out.hidden_states]


def tok_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[T] relative error per token."""
    a, b = a.float(), b.float()
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_arch_through_every_stage(arch, tmp_path, embedded_target, monkeypatch):
    """Features from vLLM's running target match HF float32 at the recorded layers (median per-token
    error < 5%, the neighbouring layers 4x farther; the MLA rope defect alone made it 35%), a few TTT
    steps train on them, the export loads and drafts in vLLM with the target (an MLA target on a CPU
    without AMX: eyas refuses with MLA_DRAFT_BLOCKS, and vLLM left to try still fails). vLLM CPU runs these MoE
    targets in bf16 and errors grow with depth in a random model (gpt-oss: 0.6% at layer 1, 3% at 3);
    a routing tie flips a token or two, so the median, not the max, is the bar."""
    from eyas.export import export_checkpoint, verify_draft
    from eyas.extract import extract
    from eyas.features import open_features
    from eyas.train.loop import train

    target = make_tiny_target(tmp_path / arch, embedded_target, arch=arch, hidden=128)
    if arch == "kimi_k25":  # served text-only, as eyas serves a multimodal target (run.language_model_only)
        monkeypatch.setenv(ENV_LM_ONLY, "1")
    data = tmp_path / "convs.jsonl"
    data.write_text("".join(json.dumps({**c, "id": f"{c['id']}{i}"}) + "\n" for i in range(4) for c in CONVS))
    feats = tmp_path / "feat"
    extract(ExtractConfig(target=str(target), data=str(data), out=str(feats), backend="vllm",
                          layer_ids=LAYER_IDS, max_len=512, kv_cache_gib=1))
    ds = open_features(feats)
    for s in list(ds)[:2]:
        hs = hf_states(target, s["input_ids"])
        for j, k in enumerate(LAYER_IDS):
            e = tok_err(s["aux_hidden_states"][:, j], hs[k]).median().item()
            assert e < 0.05, (arch, s["id"], k, e)
            for kk in (k - 1, k + 1):
                assert e < 0.25 * tok_err(s["aux_hidden_states"][:, j], hs[kk]).median().item(), (arch, k, kk)
        assert tok_err(s["last_hidden_states"], hs[-1]).median().item() < 0.05

    run = tmp_path / "train"
    train(TrainConfig(target=str(target), features=str(feats), out=str(run), max_steps=6, ttt_steps=2,
                      draft_vocab_size=512, lr=2e-3, warmup_steps=1, token_budget=512, save_every=6, eval_every=0,
                      loss_tokens="all", threads=1, precision="fp32", progress=False, log_every=1))
    draft = export_checkpoint(run / "checkpoints/step_6", tmp_path / "draft", str(target), k=2)
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == LAYER_IDS
    if draft_limit(target):  # an MLA target on a CPU without AMX: eyas says so before vLLM starts
        with pytest.raises(DraftNotServable, match="MLA_DRAFT_BLOCKS"):
            verify_draft(draft, target, k=2)
        monkeypatch.setenv("EYAS_VLLM_FIXES", "0")  # let vLLM try: if this passes, drop MLA_DRAFT_BLOCKS
        with pytest.raises(RuntimeError, match="No common block size"):
            verify_draft(draft, target, k=2)
        return
    rep = verify_draft(draft, target, k=2)
    assert rep["num_drafts"] > 0 and 1.0 <= rep["acceptance_length"] <= 3.0, rep


# ---------------------------------------------------------------- the workarounds, pinned

def _vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config

    return set_current_vllm_config(VllmConfig())


@pytest.mark.slow
def test_mla_rope_defect_and_workaround(tmp_path, embedded_target):
    """MLA_ROPE: vLLM CPU's rotary kernel on the strided [T, heads, 64] q_pe view MLA passes differs from
    vLLM's own PyTorch rope (the defect: if this fails, vLLM fixed it and the workaround can go), and
    eyas asks an MLA target's engines for the PyTorch rope on CPU (tiny DeepSeek-V3 and Kimi-K2.5)."""
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with _vllm_config():
        rope = get_rope(64, max_position=256, is_neox_style=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, dtype=torch.float32)
    T, H = 7, 4
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, H, 96, generator=g)  # [T, heads, nope 32 + rope 64], as MLA's q
    kv = torch.randn(T, 576, generator=g)  # the latent: kv_c 512 + k_pe 64
    pos = torch.arange(T)
    ref_q, ref_k = rope.forward_native(pos, q[..., 32:].clone(), kv[..., 512:].unsqueeze(1).clone())
    qv, kv_ = q.clone(), kv.clone()
    cpu_q, cpu_k = rope.forward_cpu(pos, qv[..., 32:], kv_[..., 512:].unsqueeze(1))
    assert not torch.allclose(cpu_q, ref_q, atol=1e-3) or not torch.allclose(cpu_k, ref_k, atol=1e-3), \
        "vLLM's CPU rope now handles MLA's strided views: drop MLA_ROPE from eyas.vllm_fixes"
    for arch in ("deepseek_v3", "kimi_k25"):
        target = make_tiny_target(tmp_path / arch, embedded_target, arch=arch, hidden=128)
        assert engine_options(target)["compilation_config"] == {"custom_ops": ["-rotary_embedding"]}
    assert "compilation_config" not in engine_options(embedded_target)


@pytest.mark.slow
def test_sigmoid_router_defect_and_workaround():
    """SIGMOID_ROUTER: vLLM CPU's own router refuses sigmoid scoring (the defect), and the method eyas's
    plugin installs routes as transformers' MiniMaxM2TopKRouter does (same experts, same weights)."""
    from transformers import MiniMaxM2Config
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter
    from vllm.model_executor.layers.fused_moe.router import cpu_router

    from eyas.vllm_fixes import register

    register()  # what vLLM's plugin loader calls in every process (idempotent)
    register()
    patched = cpu_router.CPURouter._compute_routing
    assert getattr(patched, "eyas_fix", None) == "SIGMOID_ROUTER"
    assert getattr(patched.eyas_original, "eyas_fix", None) is None  # patched once, not twice
    E, k, T, Hd = 8, 2, 16, 32
    g = torch.Generator().manual_seed(0)
    hf = MiniMaxM2TopKRouter(MiniMaxM2Config(num_local_experts=E, num_experts_per_tok=k, hidden_size=Hd))
    with torch.no_grad():
        hf.weight.copy_(torch.randn(E, Hd, generator=g))
    x, bias = torch.randn(T, Hd, generator=g), 0.3 * torch.randn(E, generator=g)
    logits, want_w, want_ids = hf(x, bias)

    class Router:  # the attributes CPURouter routes with, as vLLM's minimax_m2.py sets them
        top_k, renormalize, scoring_func, routed_scaling_factor = k, True, "sigmoid", 1.0
        use_grouped_topk, custom_routing_function, e_score_correction_bias = False, None, bias
        topk_group = num_expert_group = None

    with pytest.raises(AssertionError):  # vLLM's own method: `assert self.scoring_func == "softmax"`
        patched.eyas_original(Router(), x, logits.detach(), None)
    w, ids = patched(Router(), x, logits.detach(), None)
    a, b = ids.long().sort(-1), want_ids.sort(-1)
    assert torch.equal(a.values, b.values)
    torch.testing.assert_close(w.gather(1, a.indices), want_w.detach().gather(1, b.indices))


@pytest.mark.slow
def test_spec_sampling_expand_defect_and_workaround():
    """SPEC_SAMPLING_EXPAND: vLLM CPU's C++ override of the rejection sampler's expand kernel (what
    expand_batch_to_tokens runs there) writes an int64 output and leaves a float32 one (the temperatures)
    unwritten: the defect; the PyTorch expansion eyas's plugin installs gives each request's value over its
    draft positions, for float and int tensors. (The kernel is called directly: vLLM's own override
    registration rescans every loaded module and trips over some in a long test process. The engine-level
    check: tests/test_hybrid.py::test_sampling_with_the_hybrid_keeps_the_targets_distribution.)"""
    from vllm.platforms import current_platform
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample import rejection_sampler

    from eyas.vllm_fixes import expand_batch_to_tokens, register

    current_platform.import_kernels()  # the CPU ops built for this machine's ISA (`import vllm._C`, the
    # AVX-512 bf16 build, aborts the process on an AVX2-only CPU)
    temps, cu = torch.tensor([0.7, 0.0, 2.5]), torch.tensor([2, 3, 6], dtype=torch.int32)
    ints = torch.zeros(6, dtype=torch.int64)
    expand = cpu_triton_utils._expand_kernel_impl
    expand(ints, torch.tensor([5, 0, 7]), cu, 0, 0)
    assert ints.tolist() == [5, 5, 0, 7, 7, 7]  # int64 goes through
    floats = torch.full((6,), -7.0)
    expand(floats, temps, cu, 0, 1)
    assert torch.equal(floats, torch.full((6,), -7.0))  # the defect: a float output is never written
    want = torch.tensor([0.7, 0.7, 1.0, 2.5, 2.5, 2.5])
    assert torch.equal(expand_batch_to_tokens(temps, cu, 6, replace_from=0, replace_to=1), want)
    assert expand_batch_to_tokens(torch.tensor([5, 0, 7], dtype=torch.int32), cu, 6).tolist() == [5, 5, 0, 7, 7, 7]
    register()
    assert rejection_sampler.expand_batch_to_tokens is expand_batch_to_tokens


@pytest.mark.slow
@pytest.mark.parametrize("fixes", ["1", "0"])
def test_gpt_oss_quark_mxfp4_experts_in_vllm(tmp_path, embedded_target, monkeypatch, fixes):
    """GPTOSS_QUARK_SWIGLU: a gpt-oss with Quark MXFP4 experts (eyas quantize, layers=experts), served by
    vLLM CPU's MXFP4 MoE kernel, gives the features of its dequantized copy in HF float32 (the packed bytes
    are right) with eyas's plugin, and ~100% off without it (the defect: if this half fails, vLLM passes
    gpt-oss's swiglu constants itself and the workaround can go). vLLM CPU runs MXFP4 MoE on AMX only."""
    from eyas.config import QuantizeConfig
    from eyas.extract import make_extractor
    from eyas.host import machine
    from eyas.quant.quantize import quantize_model

    if "amx_bf16" not in machine()["isa"]:
        pytest.skip("vLLM CPU's MXFP4 MoE kernel needs AMX; this machine has none")
    src = make_tiny_target(tmp_path / "src", embedded_target, arch="gpt_oss", hidden=128)
    q = tmp_path / "q"
    quantize_model(QuantizeConfig(model=str(src), out=str(q), layers="experts", emulate=True), log=lambda m: None)
    monkeypatch.setenv("EYAS_VLLM_FIXES", fixes)  # read by the plugin in vLLM's own processes
    with make_extractor(q, "vllm", layer_ids=LAYER_IDS, max_len=512, compute_dtype="bf16", kv_cache_gib=1) as ex:
        out = ex.extract(CONVS)
    errs = []
    for s in out:
        hs = hf_states(q / "emulated", s["input_ids"])
        errs += [tok_err(s["aux_hidden_states"][:, j], hs[k]).median().item() for j, k in enumerate(LAYER_IDS)]
    if fixes == "1":
        assert max(errs) < 0.05, errs
    else:
        assert max(errs) > 0.3, f"vLLM runs Quark MXFP4 gpt-oss experts right now: drop GPTOSS_QUARK_SWIGLU {errs}"
