"""What every extraction backend shares: rendering conversations as the engine does, the
conversations file, and the `Extractor` interface the backends implement (`hf`, `vllm`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from eyas.chat import load_chat_template, load_tokenizer, render_with_mask, template_hash, validate_messages
from eyas.config import ExtractConfig, choices
from eyas.host import engine_dtype
from eyas.io import iter_jsonl
from eyas.manifest import tokenizer_hash
from eyas.stage import inherited
from eyas.target import facts as target_facts
from eyas.target import resolve_layer_ids

BACKENDS = choices(ExtractConfig, "backend")
MODES = choices(ExtractConfig, "mode")
COMPUTE_DTYPES = choices(ExtractConfig, "compute_dtype")


# ---------------------------------------------------------------- rendering

class Renderer:
    """Conversations -> `input_ids` / `loss_mask` exactly as the serving engine renders them."""

    def __init__(self, target: str | os.PathLike, chat_template: str = "", max_len: int = 2048):
        self.tokenizer = load_tokenizer(target)
        self.template = load_chat_template(target, chat_template, tok=self.tokenizer)
        self.template_hash = template_hash(self.template)
        self.tokenizer_hash = tokenizer_hash(target)
        self.max_len = max_len

    def render(self, conv: dict[str, Any], where: str = "conversation") -> dict[str, Any]:
        """-> {id, input_ids int64 [T], loss_mask bool [T], truncated}; T <= max_len."""
        import torch

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
    p = Path(path)
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for n, conv in iter_jsonl(p, "a conversations file: make one with `eyas synth`"):
        if not isinstance(conv, dict) or "messages" not in conv:
            raise ValueError(f"{p}:{n}: expected an object with 'messages'")
        cid = str(conv.get("id", f"line{n}"))
        if cid in seen:
            raise ValueError(f"{p}:{n}: duplicate id {cid!r}")
        seen.add(cid)
        out.append({**conv, "id": cid})
        if limit and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"{p}: no conversations (an empty file); make one with `eyas synth`")
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


def resolve_lengths(cfg: ExtractConfig) -> ExtractConfig:
    """`cfg` with `max_len` set: given, or the synthesis' max_model_len that made `cfg.data`, or 2048."""
    return dataclasses.replace(cfg, max_len=inherited(cfg.max_len, cfg.data, "synth", "max_model_len", 2048))


def resolve_compute_dtype(backend: str, compute_dtype: str) -> str:
    """bf16 | fp32 for `backend`; auto is bf16 for hf and the engine dtype for vllm."""
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"unknown compute dtype {compute_dtype!r}: {' | '.join(COMPUTE_DTYPES)}")
    if compute_dtype != "auto":
        return compute_dtype
    if backend == "vllm":
        return {"bfloat16": "bf16", "float32": "fp32"}.get(engine_dtype(), "bf16")
    return "bf16"
