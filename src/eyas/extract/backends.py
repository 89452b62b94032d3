"""Pick and build an extraction backend (`hf` | `vllm`) from arguments or an ExtractConfig."""

from __future__ import annotations

import os
from typing import Any

from eyas.config import ExtractConfig
from eyas.extract.base import BACKENDS, Extractor, resolve_compute_dtype


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


def extractor_from_config(cfg: ExtractConfig, target: str | os.PathLike) -> Extractor:
    return make_extractor(target, cfg.backend, cfg.layer_ids or None, compute_dtype=cfg.compute_dtype,
                          device=cfg.device, max_len=cfg.max_len, batch_tokens=cfg.batch_tokens,
                          chat_template=cfg.chat_template, kv_cache_gib=cfg.kv_cache_gib)
