import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eyas.checkpoints import resolve_checkpoint
from eyas.draft.contract import random_draft, validate_draft
from eyas.draft.spec import LINEARS
from eyas.export import serve_command, write_draft


def tensors(d: Path) -> dict[str, torch.Tensor]:
    return load_file(str(d / "model.safetensors"))


@pytest.fixture(scope="module")
def draft_bf16(tiny_llama, tmp_path_factory) -> Path:
    state, cfg = random_draft(tiny_llama, draft_vocab_size=512)
    return write_draft(state, cfg, tmp_path_factory.mktemp("export") / "draft", tiny_llama)


def test_write_draft_layout(draft_bf16, tiny_llama):
    umask = os.umask(0)
    os.umask(umask)
    for f in draft_bf16.iterdir():  # other users can serve it (safetensors alone writes 0600)
        assert f.stat().st_mode & 0o777 == 0o666 & ~umask, f
    cfg = json.loads((draft_bf16 / "config.json").read_text())
    tcfg = json.loads((tiny_llama / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["vocab_size"] == tcfg["vocab_size"] == 49152
    assert cfg["draft_vocab_size"] == 512 and cfg["target_hidden_size"] == 64
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and "num_aux_hidden_states" not in cfg
    assert cfg["torch_dtype"] == "bfloat16" and "quantization_config" not in cfg
    t = tensors(draft_bf16)
    assert t["fc.weight"].shape == (64, 3 * 64) and t["fc.weight"].dtype == torch.bfloat16
    assert t["midlayer.self_attn.q_proj.weight"].shape == (64, 128)  # q/k/v take [embed, hidden] = 2H
    assert t["midlayer.self_attn.k_proj.weight"].shape == (32, 128)
    assert t["lm_head.weight"].shape == (512, 64)
    assert t["d2t"].dtype == torch.int64 and t["d2t"].shape == (512,)
    assert t["t2d"].dtype == torch.bool and int(t["t2d"].sum()) == 512
    for n in ("midlayer.hidden_norm", "midlayer.input_layernorm", "midlayer.post_attention_layernorm", "norm"):
        assert t[f"{n}.weight"].shape == (64,)
    assert "embed_tokens.weight" not in t  # equal to the target's: vLLM shares it
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (draft_bf16 / f).read_bytes() == (tiny_llama / f).read_bytes()
    man = json.loads((draft_bf16 / "manifest.json").read_text())
    assert man["stage"] == "export" and man["complete"] and man["validated"]["draft_vocab_size"] == 512
    assert any("embed_tokens" in x for x in man["dropped"])


def test_embed_kept_when_trained(tiny_llama, tmp_path):
    state, cfg = random_draft(tiny_llama, draft_vocab_size=512)
    state["embed_tokens.weight"] = state["embed_tokens.weight"] + 1
    d = write_draft(state, cfg, tmp_path / "d", tiny_llama)
    assert "embed_tokens.weight" in tensors(d)
    state, cfg = random_draft(tiny_llama, draft_vocab_size=512)
    d = write_draft(state, cfg, tmp_path / "d2", tiny_llama, keep_embed=True)
    assert tensors(d)["embed_tokens.weight"].shape == (49152, 64)


def test_full_vocab_draft_has_no_vocab_map(tiny_llama, tmp_path):
    state, cfg = random_draft(tiny_llama)  # draft vocab = target vocab: vLLM builds no d2t map
    d = write_draft(state, cfg, tmp_path / "d", tiny_llama)
    assert "d2t" not in tensors(d) and "t2d" not in tensors(d)


def test_norm_flags_written(tiny_llama, tmp_path):
    state, cfg = random_draft(tiny_llama, draft_vocab_size=512)
    state.update({f"fc_norm.{i}.weight": torch.ones(64) for i in range(3)})
    d = write_draft(state, cfg, tmp_path / "d", tiny_llama)
    assert json.loads((d / "config.json").read_text())["fc_norm"] is True
    assert tensors(d)["fc_norm.2.weight"].shape == (64,)


def _corrupt_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _corrupt_weights(src: Path, dst: Path, fn) -> Path:
    shutil.copytree(src, dst)
    t = tensors(dst)
    fn(t)
    save_file(t, str(dst / "model.safetensors"))
    return dst


def _d2t_out_of_range(t):
    t["d2t"][-1] = 10**6


def _d2t_not_increasing(t):
    t["d2t"][5] = -5  # target id 0, below draft id 4's target


def _d2t_absolute(t):
    t["d2t"][:] = torch.arange(512) + 100  # absolute ids written as offsets: targets 100, 102, ... out of step


def _t2d_wrong(t):
    t["t2d"][0] = False
    t["t2d"][40000] = True


@pytest.mark.parametrize(
    "kind, corrupt, message",
    [
        ("layer id >= L", dict(eagle_aux_hidden_state_layer_ids=[1, 2, 4]), r"out of range.*\[0, 4\)"),
        ("layer ids descending", dict(eagle_aux_hidden_state_layer_ids=[3, 2, 1]), "strictly ascending"),
        ("layer id count vs fc", dict(eagle_aux_hidden_state_layer_ids=[1, 3], num_aux_hidden_states=2), "fc in-features"),
        ("num_aux mismatch", dict(num_aux_hidden_states=2), "num_aux_hidden_states"),
        ("vocab", dict(vocab_size=32000), "vocab_size 32000 != the target's"),
        ("target hidden", dict(target_hidden_size=128), "target_hidden_size 128"),
        ("draft vocab", dict(draft_vocab_size=1000), r"expected \[1000"),
        ("architecture", dict(architectures=["LlamaForCausalLM"]), "architectures"),
        ("two layers", dict(num_hidden_layers=2), "num_hidden_layers"),
    ],
)
def test_validate_catches_bad_config(draft_bf16, tiny_llama, tmp_path, kind, corrupt, message):
    bad = _corrupt_config(draft_bf16, tmp_path / "bad", **corrupt)
    with pytest.raises(ValueError, match=message):
        validate_draft(bad, tiny_llama)


@pytest.mark.parametrize(
    "kind, fn, message",
    [
        ("missing norm", lambda t: t.pop("midlayer.hidden_norm.weight"), "norm 'midlayer.hidden_norm.weight' is missing"),
        ("missing final norm", lambda t: t.pop("norm.weight"), "norm 'norm.weight' is missing"),
        ("fc size", lambda t: t.update({"fc.weight": torch.zeros(64, 128, dtype=torch.bfloat16)}), "fc in-features"),
        ("d2t out of range", _d2t_out_of_range, "d2t offsets out of range"),
        ("d2t not increasing", _d2t_not_increasing, "strictly increasing"),
        ("d2t absolute ids", _d2t_absolute, "t2d is inconsistent with d2t"),
        ("d2t dtype", lambda t: t.update({"d2t": t["d2t"].to(torch.int32)}), "d2t must be int64"),
        ("t2d count", lambda t: t["t2d"].__setitem__(40000, True), "t2d marks 513"),
        ("t2d inconsistent", _t2d_wrong, "inconsistent with d2t"),
        ("input_norm without flag", lambda t: t.update({"input_norm.weight": torch.ones(192)}), "norm_before_fc"),
        ("fc_norm without flag", lambda t: t.update({"fc_norm.0.weight": torch.ones(64)}), "fc_norm: true"),
        ("q_proj 1H", lambda t: t.update({"midlayer.self_attn.q_proj.weight": torch.zeros(64, 64)}), "q_proj"),
    ],
)
def test_validate_catches_bad_weights(draft_bf16, tiny_llama, tmp_path, kind, fn, message):
    bad = _corrupt_weights(draft_bf16, tmp_path / "bad", fn)
    with pytest.raises(ValueError, match=message):
        validate_draft(bad, tiny_llama)


def test_validate_flag_without_weight(draft_bf16, tiny_llama, tmp_path):
    bad = _corrupt_config(draft_bf16, tmp_path / "bad", fc_norm=True)
    with pytest.raises(ValueError, match="norm 'fc_norm.0.weight' is missing"):
        validate_draft(bad, tiny_llama)


def test_validate_tokenizer_mismatch(draft_bf16, tiny_llama, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(draft_bf16, bad)
    (bad / "chat_template.jinja").write_text("{{ messages }}")
    with pytest.raises(ValueError, match="tokenizer files differ"):
        validate_draft(bad, tiny_llama)


def test_write_draft_refuses_without_layer_ids(tiny_llama, tmp_path):
    state, _ = random_draft(tiny_llama, draft_vocab_size=512)
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids is missing"):
        write_draft(state, {}, tmp_path / "d", tiny_llama)
    assert not (tmp_path / "d").exists()  # nothing half-written


def test_fp8_format(tiny_llama, tmp_path):
    state, cfg = random_draft(tiny_llama, draft_vocab_size=512)
    state["midlayer.mlp.down_proj.weight"][0, 0] = 1e4  # an outlier: the scale follows it, nothing overflows
    d = write_draft(state, cfg, tmp_path / "fp8", tiny_llama, dtype="fp8")
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["activation_scheme"] == "dynamic"
    with safe_open(str(d / "model.safetensors"), framework="pt") as sf:
        for lin in LINEARS:
            w, s = sf.get_tensor(f"{lin}.weight"), sf.get_tensor(f"{lin}.weight_scale")
            assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == ()
            assert torch.isfinite(w.float()).all() and w.float().abs().max() <= 448
            ref = state[lin + ".weight"].float()
            deq = w.float() * s
            if lin != "midlayer.mlp.down_proj":
                assert (deq - ref).norm() / ref.norm() < 0.05  # E4M3: 3 mantissa bits
        assert sf.get_tensor("midlayer.mlp.down_proj.weight")[0, 0].float() * sf.get_tensor(
            "midlayer.mlp.down_proj.weight_scale"
        ) == pytest.approx(1e4, rel=0.07)
        for keep in ("lm_head.weight", "norm.weight", "midlayer.hidden_norm.weight"):
            assert sf.get_tensor(keep).dtype == torch.bfloat16
        assert sf.get_tensor("d2t").dtype == torch.int64 and sf.get_tensor("t2d").dtype == torch.bool
    assert validate_draft(d, tiny_llama)["quantization"] == "fp8"
    # fp8-emulated: the same rounded weights, stored as bf16 with no quantization_config (vLLM CPU serves it)
    e = write_draft(state, cfg, tmp_path / "fp8e", tiny_llama, dtype="fp8-emulated")
    assert "quantization_config" not in json.loads((e / "config.json").read_text())
    emu, fp8 = tensors(e), tensors(d)
    assert not any(n.endswith("weight_scale") for n in emu)
    for lin in LINEARS:
        want = (fp8[f"{lin}.weight"].float() * fp8[f"{lin}.weight_scale"]).to(torch.bfloat16)
        assert emu[f"{lin}.weight"].dtype == torch.bfloat16 and torch.equal(emu[f"{lin}.weight"], want)
    assert torch.equal(emu["lm_head.weight"], fp8["lm_head.weight"])
    assert validate_draft(e, tiny_llama)["quantization"] == "none"


def test_fp8_validation_needs_scales(tiny_llama, tmp_path):
    state, cfg = random_draft(tiny_llama, draft_vocab_size=512)
    d = write_draft(state, cfg, tmp_path / "fp8", tiny_llama, dtype="fp8")
    bad = _corrupt_weights(d, tmp_path / "bad", lambda t: t.pop("fc.weight_scale"))
    with pytest.raises(ValueError, match="fc.weight_scale is missing"):
        validate_draft(bad, tiny_llama)


def test_speculators_format(tiny_llama, tmp_path):
    state, cfg = random_draft(tiny_llama, draft_vocab_size=512)
    d = write_draft(state, cfg, tmp_path / "spec", tiny_llama, fmt="speculators", k=4)
    raw = json.loads((d / "config.json").read_text())
    assert raw["speculators_model_type"] == "eagle3" and "model_type" not in raw
    sc = raw["speculators_config"]
    assert sc["proposal_methods"][0]["speculative_tokens"] == 4
    assert sc["verifier"]["name_or_path"] == str(tiny_llama)
    assert raw["norm_before_residual"] is False  # vLLM defaults it to True for this format: always written
    assert raw["transformer_layer_config"]["vocab_size"] == 49152
    assert "layers.0.self_attn.q_proj.weight" in tensors(d)
    assert validate_draft(d, tiny_llama)["format"] == "speculators"


# ---------------------------------------------------------------- checkpoints and the CLI


def test_resolve_checkpoint(tmp_path, capsys):
    ck = tmp_path / "run" / "checkpoints"
    for s in (100, 200):
        (ck / f"step_{s}").mkdir(parents=True)
    (ck / "latest").write_text("step_200\n")  # a pointer file
    os.symlink("step_100", ck / "best")
    run = tmp_path / "run"
    assert resolve_checkpoint(run, "best").name == "step_100"
    assert resolve_checkpoint(run, "latest").name == "step_200"
    assert resolve_checkpoint(run, "step_100").name == "step_100"
    assert resolve_checkpoint(run, "200").name == "step_200"
    (ck / "best").unlink()
    assert resolve_checkpoint(run, "best").name == "step_200"  # no serve-eval yet: latest, said aloud
    assert "using latest" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no checkpoint 'step_7'; available: latest, step_100, step_200"):
        resolve_checkpoint(run, "step_7")


def test_export_cli(tiny_llama, tmp_path, monkeypatch, capsys):
    from eyas import export
    from eyas.cli import main

    state, cfg = random_draft(tiny_llama, draft_vocab_size=512)
    meta = {"draft_config": {"draft_vocab_size": 512}, "layer_ids": [1, 2, 3], "target": str(tiny_llama), "step": 5}
    (tmp_path / "run" / "checkpoints" / "step_5").mkdir(parents=True)
    os.symlink("step_5", tmp_path / "run" / "checkpoints" / "latest")
    seen = []
    monkeypatch.setattr(export, "load_draft_state", lambda p: (seen.append(p), (state, meta))[1])
    out = tmp_path / "draft"
    rc = main(["export", "--run", str(tmp_path / "run"), "--out", str(out), "--checkpoint", "latest",
               "--dtype", "fp8", "--format", "vllm"])
    assert rc == 0 and seen[0].name == "step_5"
    lines = capsys.readouterr().out.strip().splitlines()
    res = json.loads(lines[-1])
    assert res["draft"] == str(out) and res["quantization"] == "fp8" and res["layer_ids"] == [1, 2, 3]
    assert any(line.startswith("vllm serve ") and '"method": "eagle3"' in line for line in lines)
    assert json.loads((out / "manifest.json").read_text())["checkpoint_step"] == 5


def test_serve_command():
    cmd = serve_command("/m/target", "/m/draft", 3)
    assert ("vllm serve /m/target --speculative-config "
            "'{\"method\": \"eagle3\", \"model\": \"/m/draft\", \"num_speculative_tokens\": 3}'") in cmd
    assert "python -m vllm.entrypoints.openai.api_server --model /m/target" in cmd
    q = serve_command("/m/q", "/m/d", 3, quantized=True, emulated="/m/q/emulated").splitlines()
    assert ("VLLM_ROCM_USE_AITER=1 VLLM_ROCM_USE_AITER_FP4_ASM_GEMM=1 vllm serve /m/q --speculative-config "
            "'{\"method\": \"eagle3\", \"model\": \"/m/d\", \"num_speculative_tokens\": 3}'") in q
    assert any("--model /m/q/emulated" in line and "api_server" in line for line in q)
    assert any("emulation copy" in line for line in q) and any("MI350" in line for line in q)


# ---------------------------------------------------------------- vLLM


@pytest.mark.slow
def test_fp8_draft_in_vllm(vllm_target, tmp_path):
    """vLLM loads the FP8 draft; on vLLM CPU 0.32 it cannot (the failure is pinned so a fix shows up)."""
    from eyas.export import verify_draft

    state, cfg = random_draft(vllm_target, draft_vocab_size=1024)
    d = write_draft(state, cfg, tmp_path / "fp8", vllm_target, dtype="fp8")
    try:
        rep = verify_draft(d, vllm_target, k=3, max_tokens=8, n_prompts=1)
    except RuntimeError as e:
        known = "static_scaled_fp8_quant() expected at most 0 argument(s)"
        if known in str(e):
            pytest.xfail("vLLM CPU: Fp8LinearMethod requantizes per-tensor shards with the CUDA-only "
                         "_C.static_scaled_fp8_quant (a zero-arg stub in the CPU build)")
        raise
    assert rep["num_drafts"] > 0 and rep["num_draft_tokens"] == 3 * rep["num_drafts"]


def test_exported_draft_loads_back_as_the_module(tiny_llama, tmp_path):
    """bench simulated runs the exported weights: the dropped embedding comes back from the target."""
    from eyas.draft.exported import load_exported
    from eyas.target import load_head

    state, cfg = random_draft(tiny_llama, draft_vocab_size=512)
    d = write_draft(state, cfg, tmp_path / "draft", tiny_llama)
    model = load_exported(d, tiny_llama)
    got = model.state_dict()
    assert torch.equal(got["fc.weight"], state["fc.weight"].float()) and torch.equal(got["d2t"], state["d2t"])
    assert torch.equal(got["embed_tokens.weight"], load_head(tiny_llama)[0].float())
