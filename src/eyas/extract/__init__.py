"""Stage 2: hidden-state extraction — offline (shards), online (per batch), streaming (ZeroMQ).

Per conversation the target sees the exact serving rendering (`eyas.chat.render_with_mask`)
and we keep, per token:

    input_ids          int64 [T]
    loss_mask          bool  [T]           assistant tokens (content + end-of-turn)
    aux_hidden_states  bf16  [T, n, H]     layer ids in vLLM's convention: id k = the residual
                                           stream after k decoder layers = HF hidden_states[k]
    last_hidden_states bf16  [T, H]        the final *normed* state (HF hidden_states[L]), the
                                           lm_head input: the trainer recovers the target's
                                           next-token distribution from it, no logits stored

Backends share one interface, `make_extractor(target, backend, layer_ids, ...)` ->
`Extractor` with `.extract(samples) -> list[dict]`: `hf` (transformers forward, the
reference) and `vllm` (the `extract_hidden_states` speculative method with eyas' CPU-safe
KV connector). Heavy imports happen inside the backends.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

BACKENDS = ("hf", "vllm")
MODES = ("offline", "online", "streaming")
COMPUTE_DTYPES = ("auto", "bf16", "fp32")


# ---------------------------------------------------------------- target facts

def target_facts(target: str | os.PathLike) -> dict[str, int]:
    """`num_layers` (L) and `hidden_size` (H) of a HF causal LM dir (text config for multimodal)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(target))
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return {"num_layers": int(text.num_hidden_layers), "hidden_size": int(text.hidden_size)}


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


# ---------------------------------------------------------------- rendering

class Renderer:
    """Conversations -> `input_ids` / `loss_mask` exactly as the serving engine renders them."""

    def __init__(self, target: str | os.PathLike, chat_template: str = "", max_len: int = 2048):
        from eyas.chat import load_chat_template, load_tokenizer, template_hash
        from eyas.manifest import tokenizer_hash

        self.tokenizer = load_tokenizer(target)
        self.template = load_chat_template(target, chat_template, tok=self.tokenizer)
        self.template_hash = template_hash(self.template)
        self.tokenizer_hash = tokenizer_hash(target)
        self.max_len = max_len

    def render(self, conv: dict[str, Any], where: str = "conversation") -> dict[str, Any]:
        """-> {id, input_ids int64 [T], loss_mask bool [T], truncated}; T <= max_len."""
        import torch

        from eyas.chat import render_with_mask, validate_messages

        msgs = validate_messages(conv.get("messages"), where)
        r = render_with_mask(self.tokenizer, msgs, self.template, where=where)
        truncated = len(r.input_ids) > self.max_len
        return {
            "id": str(conv.get("id", where)),
            "input_ids": torch.tensor(r.input_ids[: self.max_len], dtype=torch.int64),
            "loss_mask": torch.tensor(r.loss_mask[: self.max_len], dtype=torch.bool),
            "truncated": truncated,
        }


def read_conversations(path: str | os.PathLike, limit: int = 0) -> list[dict[str, Any]]:
    """Conversations JSONL `{"id", "domain", "messages"}`; ids must be unique."""
    from eyas.data.store import iter_jsonl_strict

    p = Path(path)
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for n, conv in iter_jsonl_strict(p, "a conversations file: make one with `eyas synth`"):
        if not isinstance(conv, dict) or "messages" not in conv:
            raise ValueError(f"{p}:{n}: expected an object with 'messages'")
        cid = str(conv.get("id", f"line{n}"))
        if cid in seen:
            raise ValueError(f"{p}:{n}: duplicate id {cid!r}")
        seen.add(cid)
        out.append({**conv, "id": cid})
        if limit and len(out) >= limit:
            break
    return out


# ---------------------------------------------------------------- extractor interface

class Extractor:
    """Base: `extract(samples)` takes dicts with `input_ids` (+ `loss_mask`, `id`) or with
    `messages` (rendered here), and returns dicts with `id`, `input_ids` int64 [T],
    `loss_mask` bool [T], `aux_hidden_states` [T, n, H], `last_hidden_states` [T, H]
    in `out_dtype` (bf16 by default), on the CPU unless the backend was given another
    `out_device`. Subclasses implement `_forward`."""

    backend = "?"

    def __init__(self, target: str | os.PathLike, layer_ids: list[int] | None = None, max_len: int = 2048,
                 chat_template: str = "", out_dtype: Any = None):
        import torch

        self.target = Path(target)
        facts = target_facts(self.target)
        self.num_layers: int = facts["num_layers"]
        self.hidden_size: int = facts["hidden_size"]
        self.layer_ids: list[int] = resolve_layer_ids(layer_ids, self.num_layers)
        self.max_len = max_len
        self.chat_template = chat_template
        self.out_dtype = out_dtype or torch.bfloat16
        self._renderer: Renderer | None = None

    @property
    def renderer(self) -> Renderer:
        if self._renderer is None:
            self._renderer = Renderer(self.target, self.chat_template, self.max_len)
        return self._renderer

    def _prepare(self, samples: list[dict]) -> list[dict]:
        import torch

        out = []
        for i, s in enumerate(samples):
            if "input_ids" not in s:
                if "messages" not in s:
                    raise ValueError(f"sample {i} has neither 'input_ids' nor 'messages'")
                s = {**s, **self.renderer.render(s, where=f"sample {s.get('id', i)}")}
            ids = torch.as_tensor(s["input_ids"], dtype=torch.int64).flatten()[: self.max_len]
            if ids.numel() == 0:
                raise ValueError(f"sample {s.get('id', i)} has no tokens")
            mask = s.get("loss_mask")
            mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else \
                torch.as_tensor(mask).flatten()[: self.max_len].to(torch.bool)
            out.append({"id": str(s.get("id", i)), "input_ids": ids, "loss_mask": mask})
        return out

    def extract(self, samples: list[dict]) -> list[dict]:
        prepared = self._prepare(samples)
        if not prepared:
            return []
        states = self._forward([p["input_ids"] for p in prepared])
        for p, (aux, last) in zip(prepared, states, strict=True):
            T = p["input_ids"].shape[0]
            assert aux.shape == (T, len(self.layer_ids), self.hidden_size), (aux.shape, T)
            assert last.shape == (T, self.hidden_size), (last.shape, T)
            p["aux_hidden_states"] = aux.to(self.out_dtype)
            p["last_hidden_states"] = last.to(self.out_dtype)
        return prepared

    def _forward(self, input_ids: list[Any]) -> list[tuple[Any, Any]]:
        """[T_i] int64 each -> (aux [T_i, n, H], last [T_i, H]) each."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> dict[str, Any]:
        return {"backend": self.backend, "target": str(self.target), "layer_ids": self.layer_ids,
                "num_target_layers": self.num_layers, "hidden_size": self.hidden_size}


def resolve_compute_dtype(backend: str, compute_dtype: str) -> str:
    """bf16 | fp32 for `backend`; auto is bf16 for hf and the engine dtype for vllm."""
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"unknown compute dtype {compute_dtype!r}: {' | '.join(COMPUTE_DTYPES)}")
    if compute_dtype != "auto":
        return compute_dtype
    if backend == "vllm":
        from eyas.host import engine_dtype

        return {"bfloat16": "bf16", "float32": "fp32"}.get(engine_dtype(), "bf16")
    return "bf16"


def make_extractor(target: str | os.PathLike, backend: str = "hf", layer_ids: list[int] | None = None, *,
                   compute_dtype: str = "auto", device: str = "cpu", max_len: int = 2048,
                   batch_tokens: int = 8192, chat_template: str = "", kv_cache_gib: float = 1.0,
                   out_dtype: Any = None, out_device: str = "cpu") -> Extractor:
    """An extractor for `target` (a HF dir); cheap to call repeatedly once built.

    hf: `compute_dtype` bf16|fp32 (auto: bf16) on `device` ("cpu", "cuda:0", ...), batches of at most
    `batch_tokens` padded tokens; `out_device` = `device` keeps the states there (online
    training on an accelerator: no host round trip). vllm: a vLLM engine at `compute_dtype` (auto: the
    engine dtype of `eyas.host.engine_dtype`; spawned processes, so the caller needs an
    `if __name__ == "__main__":` guard) with `kv_cache_gib` of KV cache on CPU.
    """
    compute_dtype = resolve_compute_dtype(backend, compute_dtype)
    if backend == "hf":
        from eyas.extract.hf import HFExtractor

        return HFExtractor(target, layer_ids, compute_dtype=compute_dtype, device=device, max_len=max_len,
                           batch_tokens=batch_tokens, chat_template=chat_template, out_dtype=out_dtype,
                           out_device=out_device)
    if backend == "vllm":
        from eyas.extract.vllm_backend import VLLMExtractor

        return VLLMExtractor(target, layer_ids, max_len=max_len, chat_template=chat_template,
                             kv_cache_gib=kv_cache_gib, out_dtype=out_dtype,
                             dtype={"bf16": "bfloat16", "fp32": "float32"}[compute_dtype])
    raise ValueError(f"unknown extraction backend {backend!r}: {' | '.join(BACKENDS)}")


def extractor_from_config(cfg, target: str | os.PathLike) -> Extractor:
    return make_extractor(target, cfg.backend, cfg.layer_ids or None, compute_dtype=cfg.compute_dtype,
                          device=cfg.device, max_len=cfg.max_len, batch_tokens=cfg.batch_tokens,
                          chat_template=cfg.chat_template, kv_cache_gib=cfg.kv_cache_gib)


# ---------------------------------------------------------------- offline

def _log(msg: str) -> None:
    print(f"eyas extract: {msg}", file=sys.stderr, flush=True)


def extract(cfg) -> Path:
    """Offline extraction of `cfg.data` into `cfg.out`; resumes a partial dir, skips a complete one."""
    import dataclasses

    from eyas.features import STORAGE_DTYPES, FeatureWriter
    from eyas.manifest import read_manifest, sha256_file
    from eyas.models import resolve_target

    if cfg.backend not in BACKENDS:
        raise ValueError(f"unknown backend {cfg.backend!r}: {' | '.join(BACKENDS)}")
    if cfg.dtype not in STORAGE_DTYPES:
        raise ValueError(f"unknown storage dtype {cfg.dtype!r}: {' | '.join(STORAGE_DTYPES)}")
    if cfg.compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"unknown compute dtype {cfg.compute_dtype!r}: {' | '.join(COMPUTE_DTYPES)}")
    if not cfg.data:
        raise ValueError("no conversations given: pass --data CONV.jsonl (made by `eyas synth`)")
    if not cfg.out:
        raise ValueError("no output dir given: pass --out FEAT_DIR")
    target = resolve_target(cfg.target).resolve()
    facts = target_facts(target)
    layer_ids = resolve_layer_ids(cfg.layer_ids or None, facts["num_layers"])
    renderer = Renderer(target, cfg.chat_template, cfg.max_len)
    header = {
        "config": dataclasses.asdict(cfg),
        "target": str(target),
        "data": str(Path(cfg.data).resolve()),
        "data_sha256": sha256_file(cfg.data),
        "backend": cfg.backend,
        "compute_dtype": resolve_compute_dtype(cfg.backend, cfg.compute_dtype),
        "layer_ids": layer_ids,
        "layer_id_convention": "k = residual stream after k decoder layers = HF hidden_states[k]",
        "last_hidden_states": "final normed state = HF hidden_states[L] = lm_head input",
        "dtype": cfg.dtype,
        "hidden_size": facts["hidden_size"],
        "num_target_layers": facts["num_layers"],
        "tokenizer_hash": renderer.tokenizer_hash,
        "template_hash": renderer.template_hash,
        "max_len": cfg.max_len,
    }
    writer = FeatureWriter(cfg.out, header, cfg.samples_per_shard)
    convs = read_conversations(cfg.data, cfg.limit)
    done = writer.done_ids
    prev = read_manifest(cfg.out) or {}
    done |= set(prev.get("skipped_ids", []))
    todo = [c for c in convs if c["id"] not in done]
    if writer.complete and not todo:
        _log(f"{cfg.out} is complete; nothing to do")
        return Path(cfg.out)
    if writer.removed:
        _log(f"resuming: removed partial files {writer.removed}")
    _log(f"{len(convs)} conversations, {len(done)} already extracted, {len(todo)} to do "
         f"(backend {cfg.backend}, layers {layer_ids}, storage {cfg.dtype})")
    skipped: list[str] = []
    t0, ntok = time.time(), 0
    extractor = extractor_from_config(cfg, target) if todo else None
    try:
        for start in range(0, len(todo), cfg.samples_per_shard):
            chunk = []
            for c in todo[start : start + cfg.samples_per_shard]:
                r = renderer.render(c, where=f"{cfg.data}: id {c['id']}")
                if not bool(r["loss_mask"].any()):
                    skipped.append(c["id"])  # no assistant token within max_len: nothing to learn
                    continue
                chunk.append(r)
            if not chunk:
                continue
            assert extractor is not None
            for r, s in zip(chunk, extractor.extract(chunk), strict=True):
                writer.add(s, truncated=r["truncated"])
                ntok += s["input_ids"].shape[0]
            writer.flush()
            rate = ntok / max(time.time() - t0, 1e-9)
            _log(f"{sum(s['num_samples'] for s in writer.shards)}/{len(convs)} conversations, {rate:.0f} tok/s")
    finally:
        if extractor is not None:
            extractor.close()
    skipped = sorted(set(prev.get("skipped_ids", [])) | set(skipped))
    man = writer.finish(skipped_no_assistant=len(skipped), skipped_ids=skipped)
    _log(f"done: {man['num_samples']} samples, {man['num_tokens']} tokens, {man['truncated']} truncated, "
         f"{len(skipped)} without assistant tokens skipped, {man['bytes'] / 1e6:.1f} MB in {man['num_shards']} shards")
    return Path(cfg.out)


# ---------------------------------------------------------------- CLI

def cli(cfg, actions: list[str]) -> int:
    """`eyas extract [--mode offline|online|streaming] ...`, `eyas extract --verify FEAT`."""
    from eyas.features import verify_features

    ec = cfg.extract
    if actions and actions[0] == "verify":
        ec.verify = actions[1] if len(actions) > 1 else ec.verify or ec.out
    elif actions:
        raise ValueError(f"unknown action {actions[0]!r}; usage: eyas extract [--verify FEAT] [--mode ...]")
    if ec.verify:
        print(json.dumps(verify_features(ec.verify), indent=2))
        return 0
    if ec.mode not in MODES:
        raise ValueError(f"unknown mode {ec.mode!r}: {' | '.join(MODES)}")
    if ec.mode == "offline":
        print(extract(ec))
        return 0
    if ec.mode == "online":
        _log("online mode writes nothing: the trainer calls make_extractor(...).extract(batch) per step "
             "(train.source=online)")
        return 0
    from eyas.extract.stream import run_producer

    return run_producer(ec)
