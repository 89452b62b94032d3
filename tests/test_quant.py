"""MXFP4 quantization: bytes vs torchao, error bounds, bad input, the Quark checkpoint, vLLM's parser."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eyas.config import QuantizeConfig
from eyas.quant import mxfp4
from eyas.quant.quantize import INDEX, quantize_model


def torchao_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: torchao's to_mx (E2M1, block 32, scale rule EVEN), with -0 codes mapped to +0."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    scale, data = to_mx(w.contiguous(), torch.float4_e2m1fn_x2, 32, scaling_mode=ScaleCalculationMode.EVEN)
    data = data.view(torch.uint8)
    lo, hi = data & 0xF, data >> 4
    lo, hi = torch.where(lo == 8, 0, lo), torch.where(hi == 8, 0, hi)
    return (lo | hi << 4).to(torch.uint8), scale.view(torch.uint8)


def assert_same_as_torchao(w: torch.Tensor) -> None:
    packed, scales = mxfp4.quantize(w)
    ref_packed, ref_scales = torchao_mxfp4(w)
    assert packed.shape == (*w.shape[:-1], w.shape[-1] // 2) and scales.shape == (*w.shape[:-1], w.shape[-1] // 32)
    assert torch.equal(scales, ref_scales), f"{(scales != ref_scales).sum()} scale bytes differ"
    assert torch.equal(packed, ref_packed), f"{(packed != ref_packed).sum()} element bytes differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 256), (3, 17, 96)])
def test_bytes_match_torchao_random(dtype, shape):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) * torch.logspace(-20, 20, shape[-1])  # magnitudes vary block to block
    assert_same_as_torchao(w.to(dtype))


def edge_blocks() -> torch.Tensor:
    """[rows, 32] float32 blocks exercising ties, clamps, zeros, tiny / huge and subnormal values."""
    ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0]
    rows = [
        torch.zeros(32),
        torch.tensor(ties * 2),  # scale 2**0: every half-step tie, both signs
        torch.tensor(ties * 2) * 2.0**-20,  # the same ties at another scale
        torch.full((32,), 6.96),  # block max mantissa 1.74: scale stays, values clamp to 6
        torch.full((32,), 7.0),  # mantissa 1.75: scale rounds up, 3.5 ties to 4
        torch.linspace(-8, 8, 32),
        torch.tensor([0.1] * 31 + [1e-3]),  # small values under one big scale round to +0
        torch.tensor([-1e-3] * 31 + [10.0]),  # negatives rounding to zero: +0, never -0
        torch.full((32,), 1e-30),
        torch.full((32,), 2.0**-130),  # float32 / bf16 subnormals: scale byte 0
        torch.tensor([2.0**-149] * 16 + [-(2.0**-140)] * 16),
        torch.full((32,), 1.5 * 2.0**-125),  # just under the 2**-124 edge of scale byte 0
        torch.full((32,), 2.0**-124),
        torch.full((32,), 3.0e38),  # huge
        torch.tensor([torch.finfo(torch.bfloat16).max] + [1.0] * 31),
    ]
    return torch.stack(rows)


def test_bytes_match_torchao_edge_cases():
    w = edge_blocks()
    assert_same_as_torchao(w)
    assert_same_as_torchao(w.to(torch.bfloat16))


def test_known_codes_and_nibble_order():
    w = torch.tensor([[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] + [-0.5, -6.0, -0.1, 0.0] * 6])
    packed, scales = mxfp4.quantize(w)
    assert scales.tolist() == [[127]]  # max 6 = 1.5 * 2**2 -> scale 2**0
    codes = mxfp4.unpack_codes(packed)[0].tolist()
    # 6->7, .25->0 (tie down), .75->2 (up to 1), 1.25->2 (down to 1), 1.75->4 (up to 2), 2.5->4, 3.5->6, 5->6
    assert codes[:8] == [7, 0, 2, 2, 4, 4, 6, 6]
    assert codes[8:12] == [0x9, 0xF, 0x0, 0x0]  # -.5, -6, -0.1 -> +0, 0
    assert packed[0, 0].item() == 0x07  # element 0 in the low nibble, element 1 in the high one


def test_bytes_match_torchao_real_weights(embedded_target):
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.15.mlp.down_proj.weight",
             "model.layers.29.self_attn.v_proj.weight", "model.embed_tokens.weight"]
    with safe_open(embedded_target / "model.safetensors", framework="pt") as f:
        for name in names:
            w = f.get_tensor(name)
            assert_same_as_torchao(w[:4096])


def test_round_trip_error_bounds():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(128, 512, generator=g) * torch.logspace(-3, 3, 512)
    packed, scales = mxfp4.quantize(w)
    dq = mxfp4.dequantize(packed, scales, torch.float32)
    blocks, dq_blocks = w.reshape(128, 16, 32), dq.reshape(128, 16, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    step = 2.0 ** (scales.float() - 127).unsqueeze(-1)  # E2M1 spacing is at most 2 * scale: error <= scale
    err = (blocks - dq_blocks).abs()
    assert (err <= step).all() and (err <= amax / 3.5).all()
    assert ((blocks - dq_blocks).norm() / blocks.norm()).item() < 0.15
    assert torch.equal(mxfp4.dequantize(packed, scales, torch.bfloat16).float(), dq)  # exact in bf16
    packed2, scales2 = mxfp4.quantize(dq)  # MXFP4 values re-quantize to themselves
    assert torch.equal(packed2, packed) and torch.equal(scales2, scales)


@pytest.mark.parametrize(
    "w, msg",
    [
        (torch.tensor([[float("nan")] + [1.0] * 31]), "NaN/Inf"),
        (torch.tensor([[float("inf")] + [1.0] * 31]), "NaN/Inf"),
        (torch.ones(4, 48), "divisible"),
        (torch.ones(4, 32, dtype=torch.int32), "floating"),
    ],
)
def test_bad_input(w, msg):
    with pytest.raises(ValueError, match=rf"layers\.3\.mlp\.up_proj\.weight.*{msg}"):
        mxfp4.quantize(w, name="layers.3.mlp.up_proj.weight")


# ---- the checkpoint ----


def _cfg(model, out, **kw) -> QuantizeConfig:
    return QuantizeConfig(model=str(model), out=str(out), **kw)


@pytest.fixture(scope="module")
def quantized_llama(tiny_llama, tmp_path_factory) -> Path:
    man = quantize_model(_cfg(tiny_llama, tmp_path_factory.mktemp("q") / "q", emulate=True), log=lambda m: None)
    return Path(man["out"])


def test_checkpoint_round_trip(tiny_llama, quantized_llama):
    q = quantized_llama
    src, qt, emu = (load_file(p / "model.safetensors") for p in (tiny_llama, q, q / "emulated"))
    quantized = [n for n in src if n + "_scale" in qt]
    assert len(quantized) == 4 * 7  # q k v o gate up down per layer
    for name, w in src.items():
        if name in quantized:
            packed, scales = qt[name], qt[name + "_scale"]
            assert packed.dtype == scales.dtype == torch.uint8
            assert packed.shape == (w.shape[0], w.shape[1] // 2) and scales.shape == (w.shape[0], w.shape[1] // 32)
            dq = mxfp4.dequantize(packed, scales, torch.bfloat16)
            assert torch.equal(dq, emu[name]), name  # the emulated copy is exactly the MXFP4 weights
            assert (dq.float() - w.float()).norm() / w.float().norm() < 0.15
        else:
            assert torch.equal(qt[name], w) and torch.equal(emu[name], w), name  # embeddings, norms untouched
    config = json.loads((q / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "quark"
    assert config["quantization_config"]["exclude"] == ["lm_head"]
    assert "quantization_config" not in json.loads((q / "emulated" / "config.json").read_text())
    for d in (q, q / "emulated"):
        assert (d / "tokenizer.json").exists() and (d / "chat_template.jinja").exists()
    man = json.loads((q / "manifest.json").read_text())
    assert man["complete"] and man["tensors"]["quantize"] == 28 and man["emulated"] == str(q / "emulated")
    assert man["bytes_out"] < man["bytes_in"] and man["params"]["quantized"] == sum(src[n].numel() for n in quantized)
    assert quantize_model(_cfg(tiny_llama, q, emulate=True), log=lambda m: None) == man  # complete: skipped


def test_sharded_resume_and_exclude(tiny_llama, tmp_path):
    src = tmp_path / "src"  # re-shard the tiny llama into two files with an index
    shutil.copytree(tiny_llama, src)
    tensors = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    names = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": names[: len(names) // 2],  # two shards + an index
             "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for file, keys in parts.items():
        save_file({k: tensors[k] for k in keys}, src / file, metadata={"format": "pt"})
    (src / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {k: f for f, ks in parts.items() for k in ks}}))

    out = tmp_path / "q"
    cfg = _cfg(src, out, exclude=["re:.*down_proj"])
    quantize_model(cfg, log=lambda m: None)
    first = load_file(out / "model-00002-of-00002.safetensors")
    index = json.loads((out / INDEX).read_text())["weight_map"]
    assert set(index) == {k for f in parts for k in load_file(out / f)}
    assert index["model.layers.0.mlp.up_proj.weight_scale"] == index["model.layers.0.mlp.up_proj.weight"]
    assert "model.layers.0.mlp.down_proj.weight_scale" not in index
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qconfig["exclude"] == ["lm_head", "re:.*down_proj"]

    # a killed run: manifest not complete, second shard missing -> resumes and writes the same bytes
    man = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**man, "complete": False}))
    (out / "model-00002-of-00002.safetensors").unlink()
    logs: list[str] = []
    quantize_model(cfg, log=logs.append)
    assert any("already written" in m for m in logs)
    second = load_file(out / "model-00002-of-00002.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_moe_experts_quantized_routers_kept(tiny_moe, tmp_path):
    out = Path(quantize_model(_cfg(tiny_moe, tmp_path / "q"), log=lambda m: None)["out"])
    qt = load_file(out / "model.safetensors")
    assert qt["model.layers.0.mlp.experts.3.down_proj.weight"].dtype == torch.uint8
    assert qt["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16  # the router stays bf16 ...
    exclude = json.loads((out / "config.json").read_text())["quantization_config"]["exclude"]
    assert "model.layers.0.mlp.gate" in exclude  # ... and says so, since vLLM's Qwen3-MoE gate takes quant_config


def test_refuses_bad_models(tiny_llama, tmp_path, quantized_llama):
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(_cfg(quantized_llama, tmp_path / "a"))
    bad = tmp_path / "nan"
    shutil.copytree(tiny_llama, bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.2.self_attn.o_proj.weight"][3, 5] = float("nan")
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.2\.self_attn\.o_proj\.weight.*NaN"):
        quantize_model(_cfg(bad, tmp_path / "b"), log=lambda m: None)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "x.txt").write_text("not ours")
    with pytest.raises(ValueError, match="not an eyas quantize output"):
        quantize_model(_cfg(tiny_llama, tmp_path / "foreign"), log=lambda m: None)


# ---- vLLM's own Quark parser accepts the config and picks its OCP MX scheme (CPU, no engine) ----


def test_vllm_quark_config_accepts(quantized_llama, tiny_moe, tmp_path, monkeypatch):
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
    from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear, UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.model_executor.layers.quantization.quark import quark_moe
    from vllm.model_executor.layers.quantization.quark.quark import QuarkLinearMethod
    from vllm.model_executor.layers.quantization.quark.schemes import QuarkOCP_MX, quark_ocp_mx
    from vllm.model_executor.layers.quantization.utils.quant_utils import kMxfp4Dynamic, kMxfp4Static
    from vllm.model_executor.models.llama import LlamaForCausalLM

    def load(d: Path):
        raw = json.loads((d / "config.json").read_text())["quantization_config"]
        qc = get_quantization_config(raw["quant_method"]).from_config(raw)
        qc.packed_modules_mapping = dict(LlamaForCausalLM.packed_modules_mapping)  # as the model sets it
        return qc

    qc = load(quantized_llama)
    wkey, akey, scheme = qc.get_scheme_cls(QKVParallelLinear, "model.layers.0.self_attn.qkv_proj")
    assert (wkey, akey, scheme) == (kMxfp4Static, None, QuarkOCP_MX)
    assert qc.get_quant_method_target("model.layers.3.mlp.down_proj", RowParallelLinear)[2] is QuarkLinearMethod
    assert qc.get_quant_method_target("lm_head", RowParallelLinear)[2] is UnquantizedLinearMethod

    # the parameters vLLM creates for that scheme have our tensors' shapes and dtypes
    import vllm.model_executor.parameter as vparam

    monkeypatch.setattr(quark_ocp_mx, "init_mxfp4_linear_kernel", lambda **kw: None)  # no MXFP4 kernel on CPU
    monkeypatch.setattr(vparam, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(vparam, "get_tensor_model_parallel_world_size", lambda: 1)
    layer = torch.nn.Module()
    qc.init_scheme(scheme, wkey, akey).create_weights(
        layer, output_partition_sizes=[64], input_size_per_partition=128, params_dtype=torch.bfloat16,
        weight_loader=None,
    )
    ours = load_file(quantized_llama / "model.safetensors")
    for k in ("weight", "weight_scale"):
        t = ours[f"model.layers.0.mlp.down_proj.{k}"]  # down_proj: [64, 128] in bf16
        assert (tuple(layer.get_parameter(k).shape), layer.get_parameter(k).dtype) == (tuple(t.shape), t.dtype)

    # dynamic MXFP4 activations, MoE experts quantized, routers not
    out = Path(quantize_model(_cfg(tiny_moe, tmp_path / "qm", activations="mxfp4"), log=lambda m: None)["out"])
    qm = load(out)
    assert qm.get_scheme_cls(RowParallelLinear, "model.layers.0.self_attn.o_proj")[:2] == (kMxfp4Static, kMxfp4Dynamic)
    assert qm.get_quant_method_target("model.layers.1.mlp.gate", GateLinear)[2] is UnquantizedLinearMethod
    experts = qm.get_quant_method_target("model.layers.1.mlp.experts", RoutedExperts)[2]
    assert issubclass(experts, quark_moe.QuarkMoEMethod)


def test_cli_and_bench(tiny_llama, tmp_path, capsys):
    from eyas.bench.quant import run_bench
    from eyas.cli import main

    out = tmp_path / "q"
    argv = ["quantize", "--model", str(tiny_llama), "--out", str(out), "--exclude", "re:.*o_proj",
            "--activations", "mxfp4"]
    assert main(argv) == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["exclude"] == ["lm_head", "re:.*o_proj"] and qc["global_quant_config"]["input_tensors"]["is_dynamic"]
    assert main(["quantize", "--model", str(out), "--out", str(tmp_path / "again")]) == 2
    assert "already quantized" in capsys.readouterr().err

    r = run_bench(tiny_llama, out=tmp_path / "bench", tokens=128, seq_len=64, log=lambda m: None)
    assert r["tokens_scored"] == 2 * 63 and 0 <= r["top1_agreement"] <= 1 and r["kl_bf16_mxfp4"] >= 0
    assert r["quantized_params"] == 4 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64) and r["ppl_mxfp4"] > 1
    assert json.loads((tmp_path / "bench" / "bench_quant.json").read_text()) == r


# ---- the seed's MoE targets: fused 3-D experts, experts-only preset, multimodal wrappers ----

@pytest.mark.parametrize("layers", ["all", "experts"])
def test_gpt_oss_fused_experts_quantized(embedded_target, tmp_path, layers):
    """gpt-oss's fused experts [E, in, out] become what vLLM's gpt-oss Quark loader reads:
    `.weight` [E, out, in/2] + `.weight_scale` [E, out, in/32], blocks along `in`; the emulated copy
    dequantizes back to the checkpoint's own layout; experts-only leaves attention bf16, named in exclude."""
    from eyas.bench.quant import run_bench
    from eyas.testing import make_tiny_target

    src = make_tiny_target(tmp_path / "src", embedded_target, arch="gpt_oss", hidden=128)
    man = quantize_model(_cfg(src, tmp_path / "q", layers=layers, emulate=True), log=lambda m: None)
    assert man["tensors"]["experts"] == 8  # 4 layers x (gate_up_proj, down_proj)
    orig, q = load_file(src / "model.safetensors"), load_file(tmp_path / "q" / "model.safetensors")
    emu = load_file(tmp_path / "q" / "emulated" / "model.safetensors")
    name = "model.layers.1.mlp.experts.gate_up_proj"
    E, H, I2 = orig[name].shape
    assert name not in q and q[name + ".weight"].shape == (E, I2, H // 2) and q[name + ".weight"].dtype == torch.uint8
    assert q[name + ".weight_scale"].shape == (E, I2, H // 32)
    want = mxfp4.dequantize(*mxfp4.quantize(orig[name][2].T.contiguous()), torch.bfloat16).T  # one expert, alone
    assert emu[name].shape == (E, H, I2) and torch.equal(emu[name][2], want)
    assert torch.equal(q[name + "_bias"], orig[name + "_bias"])  # biases stay as they are
    exclude = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["exclude"]
    attn = "model.layers.0.self_attn.q_proj"
    assert (attn in exclude and torch.equal(q[attn + ".weight"], orig[attn + ".weight"])) == (layers == "experts")
    r = run_bench(src, tokens=128, seq_len=64, layers=layers, log=lambda m: None)  # the bench sees the experts too
    assert r["quantized_params"] == man["params"]["quantized"]


def test_multimodal_wrapper_keeps_lm_head_and_vision(embedded_target, tmp_path):
    """Kimi-K2.5's `language_model.lm_head`, vision tower and projector stay bf16 and are named in exclude
    (vLLM matches exact names); experts-only quantizes the routed experts and nothing else."""
    from eyas.testing import make_tiny_target

    src = make_tiny_target(tmp_path / "src", embedded_target, arch="kimi_k25", hidden=128)
    quantize_model(_cfg(src, tmp_path / "q", layers="experts"), log=lambda m: None)
    q = load_file(tmp_path / "q" / "model.safetensors")
    packed = sorted(k.removesuffix(".weight_scale") for k in q if k.endswith(".weight_scale"))
    assert packed and all(".mlp.experts." in k and "shared" not in k for k in packed)
    exclude = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["exclude"]
    assert "language_model.lm_head" in exclude and q["language_model.lm_head.weight"].dtype == torch.bfloat16
    vision = [k for k in q if k.startswith(("vision_tower.", "mm_projector."))]
    assert vision and all(q[k].dtype == torch.bfloat16 for k in vision)
    assert "language_model.model.layers.1.self_attn.kv_b_proj" in exclude


def test_already_quantized_is_explained(tiny_llama, tmp_path):
    src = tmp_path / "gptoss"
    shutil.copytree(tiny_llama, src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(ValueError, match="already quantized: MXFP4 experts in OpenAI's format.*vLLM serves it as it is"):
        quantize_model(_cfg(src, tmp_path / "q"))
