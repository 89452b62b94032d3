"""The draft's on-disk contract with vLLM, checked: the weight shapes a config implies, and
`validate_draft`, which refuses what vLLM would refuse or misread. The keys and names
themselves are `eyas.draft.spec`; training writes them into checkpoints, export turns them
into `config.json` and validates the result here, eval validates before it serves. All of
it read from `vllm/model_executor/models/llama_eagle3.py`:

- aux layer id k = HF `hidden_states[k]` (vLLM collects the residual stream after k decoder
  layers, in ascending order, whatever order the config lists), so ids are strictly
  ascending and < num_hidden_layers (k = L is pre-norm in vLLM but post-norm in HF);
- `d2t` holds offsets (target id = i + d2t[i]); vLLM only builds the mapping when draft
  vocab != target vocab;
- a norm weight whose config flag is missing is dropped by vLLM without a word
  (`input_norm` without `norm_before_fc`), so both directions are refused.

Weight shapes (H draft hidden, Ht target hidden, n aux layers, nh/nkv heads of hd, I mlp, Vd/V vocabs):

    fc.weight [H, n*Ht]       midlayer.self_attn.{q,k,v,o}_proj.weight [nh*hd | nkv*hd, 2H] / [H, nh*hd]
    midlayer.mlp.{gate,up,down}_proj.weight [I, H] / [H, I]         lm_head.weight [Vd, H]
    norms [H]    d2t [Vd] int64, t2d [V] bool (when Vd != V)    embed_tokens.weight [V, H] (optional)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from eyas.draft.spec import ARCH, FROM_TARGET, LINEARS, NORMS, canonical, load_draft_config
from eyas.io import open_safetensors
from eyas.manifest import tokenizer_hash
from eyas.target import default_layer_ids, target_embed, text_config_dict


def draft_dims(cfg: dict[str, Any], target_hidden: int, vocab_size: int) -> dict[str, Any]:
    """The sizes that fix every weight shape, from a vLLM-format draft config."""
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or []
    H = int(cfg["hidden_size"])
    nh = int(cfg["num_attention_heads"])
    return {
        "H": H, "Ht": int(target_hidden), "n_aux": len(ids), "nh": nh,
        "nkv": int(cfg.get("num_key_value_heads") or nh), "hd": int(cfg.get("head_dim") or H // nh),
        "I": int(cfg["intermediate_size"]), "V": int(vocab_size), "Vd": int(cfg.get("draft_vocab_size") or vocab_size),
        "fc_norm": bool(cfg.get("fc_norm")), "norm_before_fc": bool(cfg.get("norm_before_fc")),
    }


def weight_shapes(dims: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor vLLM requires of the draft, with its shape (embed_tokens and fp8 scales are optional)."""
    H, Ht, n, nh, nkv, hd, inter = (dims[k] for k in ("H", "Ht", "n_aux", "nh", "nkv", "hd", "I"))
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (H, n * Ht),
        "midlayer.self_attn.q_proj.weight": (nh * hd, 2 * H),
        "midlayer.self_attn.k_proj.weight": (nkv * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": (nkv * hd, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, nh * hd),
        "midlayer.mlp.gate_proj.weight": (inter, H),
        "midlayer.mlp.up_proj.weight": (inter, H),
        "midlayer.mlp.down_proj.weight": (H, inter),
        "lm_head.weight": (dims["Vd"], H),
        **{f"{name}.weight": (H,) for name in NORMS},
    }
    if dims["fc_norm"]:
        shapes.update({f"fc_norm.{i}.weight": (Ht,) for i in range(n)})
    if dims["norm_before_fc"]:
        shapes["input_norm.weight"] = (n * Ht,)
    if dims["Vd"] != dims["V"]:
        shapes["d2t"] = (dims["Vd"],)
        shapes["t2d"] = (dims["V"],)
    return shapes


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

    tcfg = text_config_dict(target_dir)
    V = int(tcfg["vocab_size"])
    ids = layer_ids or default_layer_ids(tcfg["num_hidden_layers"])
    cfg = {k: tcfg[k] for k in FROM_TARGET if k in tcfg} | {"eagle_aux_hidden_state_layer_ids": ids,
                                                          "draft_vocab_size": draft_vocab_size or V}
    shapes = weight_shapes(draft_dims(cfg, tcfg["hidden_size"], V))
    g = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {}
    for name, shape in shapes.items():
        if name == "d2t":
            state[name] = torch.zeros(shape, dtype=torch.int64)  # draft id i -> target id i
        elif name == "t2d":
            state[name] = torch.arange(V) < cfg["draft_vocab_size"]
        elif len(shape) == 1:
            state[name] = torch.ones(shape, dtype=torch.bfloat16)  # norms
        else:
            state[name] = (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)
    emb = target_embed(target_dir)
    if emb is not None:
        state["embed_tokens.weight"] = emb.to(torch.bfloat16)
    return state, {"eagle_aux_hidden_state_layer_ids": ids, "draft_vocab_size": cfg["draft_vocab_size"]}


# ---------------------------------------------------------------- validation


def _tensor_info(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    info = {}
    with open_safetensors(path, "export the draft again") as sf:
        for name in sf.keys():
            sl = sf.get_slice(name)
            info[name] = (tuple(sl.get_shape()), sl.get_dtype())
    return info


def validate_draft(draft_dir: str | os.PathLike, target_dir: str | os.PathLike) -> dict[str, Any]:
    """Refuse a draft vLLM would refuse or misread for `target_dir`; ValueError names the file and field.

    Returns a summary (format, layer ids, sizes, quantization) when everything holds.
    """
    draft_dir, target_dir = Path(draft_dir), Path(target_dir)
    tcfg = text_config_dict(target_dir)
    cfg, fmt = load_draft_config(draft_dir)
    wfile = draft_dir / "model.safetensors"
    if not wfile.exists():
        raise ValueError(f"{wfile} does not exist")
    ids, quant = _check_config(cfg, fmt, tcfg, f"{draft_dir}/config.json")
    dims = draft_dims(cfg, int(tcfg["hidden_size"]), int(tcfg["vocab_size"]))
    info = {canonical(n): v for n, v in _tensor_info(wfile).items()}
    _check_tensors(info, dims, quant, wfile)
    if dims["Vd"] != dims["V"]:
        _check_vocab_map(wfile, info, dims["Vd"], dims["V"])
    draft_tok = draft_dir / "tokenizer.json"
    if draft_tok.exists() and (target_dir / "tokenizer.json").exists():
        if tokenizer_hash(draft_dir) != tokenizer_hash(target_dir):
            raise ValueError(f"{draft_dir}: tokenizer files differ from the target's ({target_dir})")
    return {
        "format": fmt,
        "layer_ids": ids,
        "hidden_size": dims["H"],
        "target_hidden_size": dims["Ht"],
        "vocab_size": dims["V"],
        "draft_vocab_size": dims["Vd"],
        "quantization": quant or "none",
        "own_embed": "embed_tokens.weight" in info,
    }


def _check_config(cfg: dict[str, Any], fmt: str, tcfg: dict[str, Any], where: str) -> tuple[list[int], str | None]:
    """The config keys vLLM reads, against the target's text config -> (layer ids, quant method)."""
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
    quant = (cfg.get("quantization_config") or {}).get("quant_method")
    if quant not in (None, "fp8"):
        raise ValueError(f"{where}: quantization_config.quant_method {quant!r} unsupported (bf16 or 'fp8')")
    return ids, quant


def _check_tensors(info: dict[str, tuple[tuple[int, ...], str]], dims: dict[str, Any], quant: str | None,
                   wfile: Path) -> None:
    """Names, shapes and dtypes of the weights against `weight_shapes(dims)`."""
    expected = weight_shapes(dims)
    H, Ht, Vd = dims["H"], dims["Ht"], dims["Vd"]
    optional: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (dims["V"], H)}
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
                "fc.weight": f"fc in-features must be n_layers * target hidden = {dims['n_aux']} * {Ht}",
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


def _check_vocab_map(wfile: Path, info: dict[str, tuple[tuple[int, ...], str]], Vd: int, V: int) -> None:
    """d2t [Vd] int64 offsets onto strictly increasing target ids in [0, V); t2d [V] bool marks exactly them."""
    import torch
    if info["d2t"][1] != "I64":
        raise ValueError(f"{wfile}: d2t must be int64 offsets, got {info['d2t'][1]}")
    if info["t2d"][1] != "BOOL":
        raise ValueError(f"{wfile}: t2d must be bool, got {info['t2d'][1]}")
    with open_safetensors(wfile, "export the draft again") as sf:
        names = {canonical(n): n for n in sf.keys()}
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
