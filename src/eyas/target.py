"""What eyas reads of a target model dir, in one place: its text config, the aux layer ids,
and the tensors the draft shares with it (token embeddings, lm_head, the final norm).

A multimodal checkpoint (a wrapper config with `text_config`) is read through its text
config; tensor names are looked up by suffix, the shortest first (the language model's).

    text_config(dir)         the HF config object of the language model
    text_config_dict(dir)    the same from config.json as a dict (no transformers import)
    facts(dir)               {"num_layers": L, "hidden_size": H}
    default_layer_ids(L)     vLLM's EAGLE-3 default aux ids (2, L//2, L-3)
    resolve_layer_ids(ids, L)
    weight_map(dir)          {tensor name: safetensors file}
    read_tensor(dir, name)
    load_head(dir)           (embed [V, H], lm_head [V, H], text config dict)
    target_embed(dir)        embed [V', H] or None
    load_language_model(dir, dtype)   the HF causal LM (a multimodal wrapper's language model only)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from eyas.io import open_safetensors, read_json


def config_dict(target: str | os.PathLike) -> dict[str, Any]:
    """The target's config.json as written (the wrapper's, for a multimodal checkpoint)."""
    return read_json(Path(target) / "config.json", "a target model dir: fetch one with `eyas models fetch`")


def text_config_dict(target: str | os.PathLike) -> dict[str, Any]:
    cfg = config_dict(target)
    return cfg.get("text_config") or cfg


def text_config(target: str | os.PathLike | Any) -> Any:
    """The language model's transformers config of a dir (or of a config object)."""
    if isinstance(target, (str, os.PathLike)):
        from transformers import AutoConfig

        target = AutoConfig.from_pretrained(str(target))
    return target.get_text_config() if hasattr(target, "get_text_config") else target


def facts(target: str | os.PathLike) -> dict[str, int]:
    """`num_layers` (L) and `hidden_size` (H) of the language model."""
    t = text_config(target)
    return {"num_layers": int(t.num_hidden_layers), "hidden_size": int(t.hidden_size)}


def default_layer_ids(num_layers: int) -> list[int]:
    """vLLM's EAGLE-3 default (2, L//2, L-3); for L < 7, where it collapses, (1, L//2, L-1)."""
    ids = [2, num_layers // 2, num_layers - 3]
    if not (ids[0] < ids[1] < ids[2]):
        ids = [1, num_layers // 2, num_layers - 1]
    if not (0 < ids[0] < ids[1] < ids[2] < num_layers):
        raise ValueError(f"a target with {num_layers} layers is too shallow for 3 aux layers; pass --layer-ids")
    return ids


def resolve_layer_ids(layer_ids: list[int] | tuple[int, ...] | None, num_layers: int) -> list[int]:
    """Ascending, unique ids in [0, L-1] (id L is the final state, kept as last_hidden_states)."""
    if not layer_ids:
        return default_layer_ids(num_layers)
    ids = [int(k) for k in layer_ids]
    if len(set(ids)) != len(ids):
        raise ValueError(f"layer ids {ids} repeat an id")
    bad = [k for k in ids if not 0 <= k < num_layers]
    if bad:
        raise ValueError(
            f"layer ids {bad} are outside [0, {num_layers - 1}] for a {num_layers}-layer target "
            f"(id k = residual stream after k layers; the final state, id {num_layers}, is always "
            "stored as last_hidden_states)"
        )
    return sorted(ids)


def target_fingerprint(target: str | os.PathLike, sample: int = 256) -> str:
    """Identity (not integrity) of a model dir in a few small reads: sha256 over config.json and,
    per weights file, its safetensors header and `sample` bytes from the middle of every tensor.
    Another checkpoint of the same architecture (a fine-tune, even of one matrix; a quantized
    copy) differs; hashing every byte of a 1 TB target would take as long as loading it. A weights
    file shorter than its header says (a download cut off) is a ValueError naming it."""
    d = Path(target)
    h = hashlib.sha256()
    if (d / "config.json").exists():
        h.update((d / "config.json").read_bytes())
    for f in sorted(d.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = fh.read(n)
            h.update(f.name.encode() + header)
            try:
                spans = sorted(tuple(v["data_offsets"]) for k, v in json.loads(header).items() if k != "__metadata__")
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{f}: not a readable safetensors file (bad header: {e}); fetch or convert the "
                                 "target again") from None
            need, size = 8 + n + max((b for _, b in spans), default=0), f.stat().st_size
            if size < need:
                raise ValueError(f"{f}: not a readable safetensors file (truncated: {size:,} of {need:,} bytes); "
                                 "fetch or convert the target again")
            for a, b in spans:
                at = 8 + n + a + max(0, (b - a - sample) // 2)
                fh.seek(at)
                h.update(fh.read(min(sample, b - a)))
    return h.hexdigest()


def weight_map(target: str | os.PathLike) -> dict[str, str]:
    """{tensor name: file name} from the safetensors index, or by opening every shard."""
    d = Path(target)
    index = d / "model.safetensors.index.json"
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{d}: no *.safetensors weights (eyas reads the target's tensors from them)")
    where: dict[str, str] = {}
    for f in files:
        with open_safetensors(f, "fetch or convert the target again") as sf:
            where.update({k: f.name for k in sf.keys()})
    return where


def find_tensor(where: dict[str, str], suffix: str) -> str | None:
    """The shortest tensor name ending in `suffix` (the language model's in a multimodal checkpoint)."""
    names = sorted((k for k in where if k.endswith(suffix)), key=len)
    return names[0] if names else None


def read_tensor(target: str | os.PathLike, name: str, where: dict[str, str] | None = None):
    where = where if where is not None else weight_map(target)
    if name not in where:
        raise ValueError(f"{target}: no tensor {name!r} in the safetensors")
    with open_safetensors(Path(target) / where[name], "fetch or convert the target again") as sf:
        return sf.get_tensor(name)


def load_head(target: str | os.PathLike):
    """(embed [V, H], lm_head [V, H], text config dict) read straight from the target's safetensors.

    A tied lm_head (or none stored) is the embedding; rows past vocab_size (padding) are cut."""
    d = Path(target)
    cfg = config_dict(d)
    tcfg = cfg.get("text_config") or cfg
    where = weight_map(d)
    emb_name = find_tensor(where, "embed_tokens.weight")
    if emb_name is None:
        raise ValueError(f"{d}: no '*embed_tokens.weight' tensor in the safetensors")
    embed = read_tensor(d, emb_name, where)
    head_name = find_tensor(where, "lm_head.weight")
    tied = bool(tcfg.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)))
    lm_head = embed if (tied or head_name is None) else read_tensor(d, head_name, where)
    V = int(tcfg["vocab_size"])
    if embed.shape[0] < V or lm_head.shape[0] < V:
        raise ValueError(f"{d}: embeddings {tuple(embed.shape)} / lm_head {tuple(lm_head.shape)} smaller than vocab {V}")
    return embed[:V], lm_head[:V], tcfg


def target_final_norm(target: str | os.PathLike):
    """The weight [H] of the norm before the target's lm_head (`*model.norm.weight`), or None."""
    where = weight_map(target)
    name = find_tensor(where, "model.norm.weight")
    return None if name is None else read_tensor(target, name, where)


def target_layer(target: str | os.PathLike, index: int) -> dict[str, Any]:
    """Decoder layer `index` of the target (negative: from the end) as {"self_attn.q_proj.weight": ..., ...},
    the names after `layers.N.` (the language model's in a multimodal checkpoint)."""
    n = int(text_config_dict(target)["num_hidden_layers"])
    i = index % n
    where = weight_map(target)
    stems = sorted({k.split(f"layers.{i}.", 1)[0] for k in where if f"layers.{i}." in k}, key=len)
    if not stems:
        raise ValueError(f"{target}: no tensors of decoder layer {i} in the safetensors")
    prefix = f"{stems[0]}layers.{i}."
    return {k[len(prefix):]: read_tensor(target, k, where) for k in where if k.startswith(prefix)}


def target_embed(target: str | os.PathLike):
    """The target's input embedding [V', H] as stored, or None when it has none."""
    where = weight_map(target)
    name = find_tensor(where, "embed_tokens.weight")
    return None if name is None else read_tensor(target, name, where)


def language_model_prefix(target: str | os.PathLike, where: dict[str, str] | None = None) -> str:
    """What the checkpoint puts before the causal LM's own names (`model.embed_tokens.weight`,
    `lm_head.weight`): "" for a plain LM, `language_model.` in the released Kimi-K2.5."""
    where = where if where is not None else weight_map(target)
    emb = find_tensor(where, "model.embed_tokens.weight")
    if emb is None:
        raise ValueError(f"{target}: no '*model.embed_tokens.weight' tensor in the safetensors")
    return emb[: -len("model.embed_tokens.weight")]


def load_language_model(target: str | os.PathLike, dtype: Any, *, meta: bool = False,
                        trust_remote_code: bool | None = None) -> Any:
    """The target's causal LM in `dtype` (transformers' class). A multimodal wrapper (a config with
    `text_config`) yields its language model alone: the text config's class, loaded by transformers
    from the checkpoint's language-model tensors (their prefix stripped; the vision tower is not built).
    `meta`: no weights (shapes and modules only). `trust_remote_code`: None takes the run's option."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from eyas.vllm_fixes import trust_remote_code as run_trusts

    trust_remote_code = run_trusts() if trust_remote_code is None else trust_remote_code
    d = Path(target)
    cfg = AutoConfig.from_pretrained(str(d), trust_remote_code=trust_remote_code)
    tcfg = text_config(cfg)
    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(tcfg, dtype=dtype, trust_remote_code=trust_remote_code)
    if tcfg is cfg:
        return AutoModelForCausalLM.from_pretrained(str(d), dtype=dtype, trust_remote_code=trust_remote_code)
    prefix = language_model_prefix(d)
    model, info = AutoModelForCausalLM.from_pretrained(
        str(d), config=tcfg, dtype=dtype, trust_remote_code=trust_remote_code, output_loading_info=True,
        key_mapping={"^" + re.escape(prefix): ""} if prefix else None)
    if info["missing_keys"]:
        raise ValueError(f"{d}: the language model's tensors {sorted(info['missing_keys'])[:3]} are not in the "
                         f"safetensors under {prefix!r}")
    return model.eval()
