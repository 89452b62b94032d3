"""Model-level MXFP4: a HF safetensors dir -> an AMD Quark-format checkpoint (+ a bf16 emulation copy).

Shards are walked tensor by tensor and written one at a time (atomically), so a model
larger than RAM quantizes shard by shard and a killed run resumes at the first missing
shard. Every 2-D linear `X.weight` [out, in] becomes uint8 `X.weight` [out, in/2] plus
uint8 `X.weight_scale` [out, in/32]; gpt-oss's fused 3-D experts `...experts.gate_up_proj`
[E, in, out] become `...gate_up_proj.weight` [E, out, in/2] + `.weight_scale` [E, out, in/32]
(what vLLM's gpt-oss Quark loader reads). Embeddings, norms, biases, MoE routers, every
`lm_head` (a multimodal wrapper's `language_model.lm_head` too), vision towers and projectors,
and excluded layers are copied unchanged and listed by exact name in `exclude`.
`quantize.layers: experts` quantizes routed experts only, as AMD's published MXFP4 MoE
checkpoints do (attention, dense and shared MLPs, routers and lm_head stay high precision).
`config.json` gets the `quantization_config` that vLLM's `QuarkConfig` parses (weight-only,
or with dynamic MXFP4 activations).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eyas.config import QuantizeConfig, RunConfig, check_choices
from eyas.io import atomic_path, open_safetensors
from eyas.lock import writing
from eyas.manifest import tokenizer_hash, write_manifest
from eyas.models import resolve_target
from eyas.quant import mxfp4
from eyas.stage import claim, output_dir, say_complete

INDEX = "model.safetensors.index.json"
EMULATED = "emulated"  # Q/emulated: dequantized bf16 copy that vLLM CPU serves
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
ALWAYS_EXCLUDE = ["lm_head"]  # vLLM's ParallelLMHead is not a Quark linear: it must stay bf16
ROUTER_LEAVES = ("gate", "router")  # MoE routers [experts, hidden] stay bf16, listed in `exclude`
EMBED_LEAVES = ("wte", "wpe")  # plus every leaf containing "embed"
MULTIMODAL_PARTS = ("vision_tower", "vision_model", "visual.", "mm_projector", "multi_modal_projector", "audio_tower")
FUSED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")  # 3-D [E, in, out] in a gpt-oss checkpoint
FUSED_LAYOUTS = ("gpt_oss",)  # model types whose fused expert layout eyas knows (and vLLM's Quark loader reads)
ROUTED_EXPERT = re.compile(r"\.experts\.(\d+\.|gate_up_proj$|down_proj$)")  # not shared_experts

MXFP4_SPEC: dict[str, Any] = {  # one OCP MX tensor spec, as Quark exports it
    "dtype": "fp4",
    "qscheme": "per_group",
    "group_size": mxfp4.BLOCK,
    "ch_axis": -1,
    "scale_format": "e8m0",
    "scale_calculation_mode": "even",
    "scale_type": "float",
    "round_method": "half_even",
    "symmetric": None,
    "observer_cls": "PerBlockMXObserver",
    "is_dynamic": False,
}


def quark_quantization_config(exclude: list[str], activations: str = "none") -> dict[str, Any]:
    """The `quantization_config` of a Quark MXFP4 export (`activations`: none | mxfp4)."""
    if activations not in ("none", "mxfp4"):
        raise ValueError(f"quantize.activations must be none | mxfp4, got {activations!r}")
    return {
        "quant_method": "quark",
        "quant_mode": "eager_mode",
        "export": {
            "kv_cache_group": [],
            "min_kv_scale": 0.0,
            "pack_method": "reorder",
            "weight_format": "real_quantized",
            "weight_merge_groups": None,
        },
        "global_quant_config": {
            "weight": dict(MXFP4_SPEC),
            "input_tensors": {**MXFP4_SPEC, "is_dynamic": True} if activations == "mxfp4" else None,
            "output_tensors": None,
            "bias": None,
            "target_device": None,
        },
        "layer_quant_config": {},
        "layer_type_quant_config": {},
        "exclude": exclude,
        "algo_config": None,
    }


def matches(module: str, patterns: list[str]) -> bool:
    """vLLM's exclude rule: an exact module name, or `re:REGEX` matched at the start (re.match)."""
    return any(re.match(p[3:], module) if p.startswith("re:") else p == module for p in patterns)


def classify(name: str, shape: tuple[int, ...], exclude: list[str], layers: str = "all") -> str:
    """quantize | experts (fused 3-D) | router | excluded | keep, for one checkpoint tensor;
    `layers`: all (every linear) | experts (routed experts only)."""
    fused = len(shape) == 3 and name.endswith(FUSED_EXPERTS)
    if not fused and (not name.endswith(".weight") or len(shape) != 2):
        return "keep"  # norms, biases, buffers, conv tensors
    module = name.removesuffix(".weight")
    leaf = module.rsplit(".", 1)[-1]
    if "embed" in leaf or leaf in EMBED_LEAVES:
        return "keep"
    if leaf == "lm_head" or matches(module, exclude) or any(p in module for p in MULTIMODAL_PARTS):
        return "excluded"
    if not fused and (leaf in ROUTER_LEAVES or leaf.endswith("_gate")):
        return "router"
    if layers == "experts" and not ROUTED_EXPERT.search(module):
        return "excluded"
    return "experts" if fused else "quantize"


def already_quantized(src: Path, qc: dict[str, Any]) -> str:
    """Why a checkpoint that ships quantized is not requantized, and what to do with it."""
    method = qc.get("quant_method", "?")
    what = {"quark": "AMD Quark ({})".format((qc.get("global_quant_config") or {}).get("weight", {}).get("dtype", "?")),
            "mxfp4": "MXFP4 experts in OpenAI's format (gpt-oss as released)",
            "compressed-tensors": "compressed-tensors (e.g. Kimi-K2.5's int4 experts as released)",
            "fp8": "block FP8 (e.g. DeepSeek-V3 as released)"}.get(method, f"quant_method {method!r}")
    return (f"{src} is already quantized: {what}. vLLM serves it as it is: point run.target at it and every "
            "stage runs against it (on-policy data from the quantized target itself); eyas quantize needs the "
            "bf16 checkpoint to write MXFP4 from")


def _shards(src: Path) -> list[str]:
    if (src / INDEX).exists():
        return sorted(set(json.loads((src / INDEX).read_text())["weight_map"].values()))
    if (src / "model.safetensors").exists():
        return ["model.safetensors"]
    raise ValueError(f"{src}: no model.safetensors or {INDEX}; eyas quantize reads safetensors checkpoints")


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})


def _copy_side_files(src: Path, dst: Path, config: dict[str, Any]) -> None:
    """config.json (given), tokenizer, chat template, generation config: every non-weight file."""
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.is_file() and not p.name.endswith(WEIGHT_FILES) and p.name not in (INDEX, "config.json", "manifest.json"):
            shutil.copy(p, dst / p.name)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def quantize_model(cfg: QuantizeConfig, log=print) -> dict[str, Any]:
    """Quantize `cfg.model` (a QuantizeConfig) into `cfg.out`; returns its manifest (`out`, `emulated`, counts).
    One writer per dir (`eyas.lock`): a second one is refused."""
    with writing(output_dir(cfg.out, "--out"), "eyas quantize"):
        return _quantize_model(cfg, log)


def _quantize_model(cfg: QuantizeConfig, log=print) -> dict[str, Any]:
    check_choices(cfg, "quantize")
    out = output_dir(cfg.out, "--out")
    src = resolve_target(cfg.model)
    if src.resolve() == out.resolve():
        raise ValueError(f"--out {out} is the source model dir; choose another")
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise ValueError(already_quantized(src, config["quantization_config"]))
    exclude = list(dict.fromkeys(ALWAYS_EXCLUDE + list(cfg.exclude)))
    plan = {"config": dataclasses.asdict(cfg), "source": str(src.resolve()), "exclude": exclude}
    o = claim(out, "quantize", plan, on_change="replace", key_of=lambda man: man.get("plan"))
    if o.complete:
        say_complete("quantize", out)
        return o.manifest
    resume = o.manifest is not None  # a partial run of this same plan: keep its finished shards
    write_manifest(out, "quantize", cfg, complete=False, plan=plan)
    emu = out / EMULATED
    if not cfg.emulate and emu.exists():
        shutil.rmtree(emu)

    t0, counts = time.time(), {"quantize": 0, "experts": 0, "router": 0, "excluded": 0, "keep": 0}
    params = {"quantized": 0, "kept": 0}
    routers: list[str] = []
    listed: list[str] = []  # excluded by eyas's rules (lm_head, vision, experts-only): named exactly for vLLM
    weight_map: dict[str, str] = {}
    for shard in _shards(src):
        with open_safetensors(src / shard, "fetch or convert the model again") as f:
            shapes = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
            kinds = {n: classify(n, shape, exclude, cfg.layers) for n, shape in shapes.items()}
            fused = [n for n, k in kinds.items() if k == "experts"]
            if fused and config.get("model_type") not in FUSED_LAYOUTS:
                raise ValueError(f"{src}: {fused[0]} is a fused 3-D expert tensor of model_type "
                                 f"{config.get('model_type')!r}; eyas knows the fused layout of {FUSED_LAYOUTS} only "
                                 f"(exclude it with quantize.exclude=re:.*experts.* to keep experts bf16)")
            for name, kind in kinds.items():
                counts[kind] += 1
                params["quantized" if kind in ("quantize", "experts") else "kept"] += math.prod(shapes[name])
                module = name.removesuffix(".weight")
                routers += [module] if kind == "router" else []
                listed += [module] if kind == "excluded" and not matches(module, exclude) else []
                stored = {"quantize": [name, name + "_scale"], "experts": [name + ".weight", name + ".weight_scale"]}
                weight_map.update({k: shard for k in stored.get(kind, [name])})
            if resume and (out / shard).exists() and (not cfg.emulate or (emu / shard).exists()):
                log(f"eyas quantize: {shard} already written; resuming after it")
                continue
            q: dict[str, torch.Tensor] = {}  # this shard's Quark tensors
            e: dict[str, torch.Tensor] = {}  # and its bf16 emulation (--emulate)
            for name, kind in kinds.items():
                t = f.get_tensor(name)
                if kind == "quantize":
                    packed, scales = mxfp4.quantize(t, name=name)  # [out, in/2], [out, in/32]
                    q[name], q[name + "_scale"] = packed, scales
                    if cfg.emulate:
                        e[name] = mxfp4.dequantize(packed, scales, torch.bfloat16)
                elif kind == "experts":  # [E, in, out] -> blocks along `in`: [E, out, in/2], [E, out, in/32]
                    packed, scales = mxfp4.quantize(t.transpose(1, 2), name=name)
                    q[name + ".weight"], q[name + ".weight_scale"] = packed, scales
                    if cfg.emulate:  # back in the checkpoint's own layout
                        e[name] = mxfp4.dequantize(packed, scales, torch.bfloat16).transpose(1, 2).contiguous()
                else:
                    q[name] = t
                    if cfg.emulate:
                        e[name] = t
        _save(q, out / shard)
        if cfg.emulate:
            emu.mkdir(parents=True, exist_ok=True)
            _save(e, emu / shard)
        del q, e
        log(f"eyas quantize: {shard} done ({time.time() - t0:.1f}s)")

    exclude_all = list(dict.fromkeys(exclude + routers + listed))
    qconfig = {**config, "quantization_config": quark_quantization_config(exclude_all, cfg.activations)}
    _copy_side_files(src, out, qconfig)
    bytes_out = sum((out / s).stat().st_size for s in set(weight_map.values()))
    if (src / INDEX).exists():
        index = {"metadata": {"total_size": bytes_out}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    fields: dict[str, Any] = dict(
        plan=plan,
        out=str(out),
        source=str(src),
        scheme="mxfp4 (OCP MX v1.0, Quark format, scale rule even)",
        activations=cfg.activations,
        exclude=exclude_all,
        tensors=counts,
        params=params,
        bytes_in=sum((src / s).stat().st_size for s in _shards(src)),
        bytes_out=bytes_out,
        seconds=round(time.time() - t0, 2),
        tokenizer_hash=tokenizer_hash(src),
        emulated=None,
    )
    if cfg.emulate:
        _copy_side_files(src, emu, config)
        if (src / INDEX).exists():
            shutil.copy(src / INDEX, emu / INDEX)
        fields["emulated"] = str(emu)
        fields["bytes_emulated"] = sum((emu / s).stat().st_size for s in _shards(src))
        write_manifest(
            emu, "quantize-emulated", cfg, complete=True, quantized=str(out), tokenizer_hash=fields["tokenizer_hash"],
            note="MXFP4 weights dequantized to bf16 (weight-only emulation; activations are not quantized here)",
        )
    return write_manifest(out, "quantize", cfg, complete=True, **fields)


def cli(q: QuantizeConfig, actions: list[str], run: RunConfig) -> int:
    if actions:
        raise ValueError(f"eyas quantize takes no actions, got {actions}; usage: eyas quantize --model DIR --out Q")
    if not q.model:
        raise ValueError("no model: pass --model NAME|DIR")
    man = quantize_model(q, log=lambda m: print(m, file=sys.stderr))
    print(
        f"{man['out']}: {man['tensors']['quantize'] + man['tensors']['experts']} tensors MXFP4, "
        f"{man['bytes_in'] / 2**20:.1f} MiB -> "
        f"{man['bytes_out'] / 2**20:.1f} MiB in {man['seconds']}s"
        + (f"; emulated copy {man['emulated']}" if man["emulated"] else "")
    )
    return 0
