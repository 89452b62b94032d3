"""`eyas bench extract`: extraction throughput vs a plain prefill, bytes per token, scaling.

Per backend: tokens/s of `Extractor.extract` over the same rendered conversations as a plain
HF prefill (`AutoModelForCausalLM` forward, no hidden-state outputs, `logits_to_keep=1` as a
serving prefill computes, the same length-sorted batches). Per storage dtype: bytes per
token measured on real shards. A scaling line for a large target (hidden 7168, 3 aux
layers): what offline storage costs per N tokens vs what streaming keeps in memory.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from eyas.bench.roofline import DTYPES, peak_flops, prefill_flops, roofline_fields
from eyas.models import resolve_target
from eyas.packing import pack_by_length
from eyas.target import text_config

LARGE_HIDDEN = 7168
LARGE_AUX = 3


def bench_conversations(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` two-turn conversations of varied length from Python's own docs (real prose)."""
    import random
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    keys = sorted(topics)
    out = []
    for i in range(n):
        key = keys[rng.randrange(len(keys))]
        words = topics[key].split()
        a = max(20, rng.randrange(40, 240))
        out.append({"id": f"bench{i}", "domain": "pydoc", "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": f"Explain `{key}` in Python."},
            {"role": "assistant", "content": " ".join(words[:a]) or key},
            {"role": "user", "content": "Go on."},
            {"role": "assistant", "content": " ".join(words[a : 2 * a]) or "That is all."},
        ]})
    return out


def _plain_prefill_tok_s(target: Path, samples: list[dict], compute_dtype: str, batch_tokens: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from eyas.extract.hf import DTYPES, pad_batch

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=DTYPES[compute_dtype]).eval()
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    batches = pack_by_length(lengths, batch_tokens)

    def run() -> None:
        for b in batches:
            ids, attn = pad_batch([samples[i]["input_ids"] for i in b], 0)
            model(input_ids=ids, attention_mask=attn, use_cache=False, logits_to_keep=1)

    with torch.inference_mode():
        model(input_ids=samples[0]["input_ids"][None], use_cache=False, logits_to_keep=1)  # warm-up
        t0 = time.perf_counter()
        run()
        dt = time.perf_counter() - t0
    return sum(lengths) / dt


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _storage_rows(samples: list[dict], layer_ids: list[int], hidden: int, num_layers: int) -> list[dict]:
    from eyas.features import FeatureWriter, bytes_per_token

    rows = []
    tokens = sum(int(s["input_ids"].shape[0]) for s in samples)
    for dtype in ("bf16", "fp8"):
        with tempfile.TemporaryDirectory(prefix="eyas-bench-") as d:
            w = FeatureWriter(d, {"layer_ids": layer_ids, "dtype": dtype, "hidden_size": hidden,
                                  "num_target_layers": num_layers}, samples_per_shard=len(samples))
            for s in samples:
                w.add(s)
            man = w.finish()
        rows.append({"kind": "storage", "dtype": dtype, "tokens": tokens, "bytes": man["bytes"],
                     "bytes_per_token": man["bytes"] / tokens,
                     "formula_bytes_per_token": bytes_per_token(hidden, len(layer_ids), dtype)})
    return rows


def _scaling_rows(window: int, max_len: int, producers: int = 1) -> list[dict]:
    from eyas.features import bytes_per_token

    rows = []
    wire = bytes_per_token(LARGE_HIDDEN, LARGE_AUX, "bf16")  # streaming sends bf16
    for tokens in (10**8, 10**9):
        rows.append({"kind": "scaling", "hidden": LARGE_HIDDEN, "aux_layers": LARGE_AUX, "tokens": tokens,
                     "offline_bf16_bytes": tokens * bytes_per_token(LARGE_HIDDEN, LARGE_AUX, "bf16"),
                     "offline_fp8_bytes": tokens * bytes_per_token(LARGE_HIDDEN, LARGE_AUX, "fp8"),
                     # credits bound what a consumer holds: window samples per producer (+1 in the caller's hands)
                     "streaming_bytes": (window * producers + 1) * max_len * wire})
    return rows


def run_bench(target: str | os.PathLike, n_samples: int = 16, backends: tuple[str, ...] = ("hf", "vllm"),
              layer_ids: list[int] | None = None, compute_dtype: str = "bf16", max_len: int = 1024,
              batch_tokens: int = 8192, window: int = 4, data: str = "", printer=print) -> list[dict]:
    """Benchmark extraction on `target`; returns the rows and prints a table.

    The vllm backend spawns engine processes: call this under `if __name__ == "__main__":`.
    """
    from eyas.extract.backends import make_extractor
    from eyas.extract.base import Renderer, read_conversations, resolve_compute_dtype

    target = resolve_target(str(target))
    convs = read_conversations(data, n_samples) if data else bench_conversations(n_samples)
    renderer = Renderer(target, max_len=max_len)
    samples = [renderer.render(c) for c in convs]
    tokens = sum(int(s["input_ids"].shape[0]) for s in samples)
    rows: list[dict] = []
    tcfg = text_config(target)
    flops = sum(prefill_flops(tcfg, int(s["input_ids"].shape[0])) for s in samples)  # the target's, per pass
    peaks = {dt: peak_flops(dt, torch_threads()) for dt in ("float32", "bfloat16")}
    baseline = _plain_prefill_tok_s(target, samples, compute_dtype, batch_tokens)
    rows.append({"kind": "throughput", "backend": f"plain-prefill (hf {compute_dtype})", "tokens": tokens,
                 "tok_s": baseline, "vs_prefill": 1.0,
                 **roofline_fields(baseline, flops / tokens, peaks[DTYPES[compute_dtype]])})
    extracted = None
    for backend in backends:
        dtype = resolve_compute_dtype(backend, compute_dtype if backend == "hf" else "auto")
        try:
            t0 = time.perf_counter()
            ex = make_extractor(target, backend, layer_ids, compute_dtype=dtype,
                                max_len=max_len, batch_tokens=batch_tokens)
            init_s = time.perf_counter() - t0
        except ValueError as e:
            rows.append({"kind": "throughput", "backend": backend, "skipped": str(e)})
            continue
        try:
            ex.extract(samples[:1])  # warm-up
            t0 = time.perf_counter()
            out = ex.extract(samples)
            dt = time.perf_counter() - t0
        finally:
            ex.close()
        rows.append({"kind": "throughput", "backend": f"{backend} ({dtype})",
                     "tokens": tokens, "tok_s": tokens / dt, "vs_prefill": tokens / dt / baseline,
                     "init_s": init_s, **roofline_fields(tokens / dt, flops / tokens, peaks[DTYPES[dtype]])})
        extracted = extracted or (out, ex.layer_ids, ex.hidden_size, ex.num_layers)
        del out
    if extracted is not None:
        out, ids, hidden, num_layers = extracted
        rows += _storage_rows(out, ids, hidden, num_layers)
    rows += _scaling_rows(window, max_len)
    printer(format_table(rows, target, compute_dtype))
    return rows


def _gb(x: float) -> str:
    return f"{x / 1e12:.1f} TB" if x >= 1e12 else f"{x / 1e9:.2f} GB"


def format_table(rows: list[dict], target: Path | str, compute_dtype: str) -> str:
    lines = [f"extraction bench: {Path(target).name}", "",
             f"{'backend':<26} {'tokens':>8} {'tok/s':>10} {'vs prefill':>11} {'init s':>8} {'GFLOP/s':>8} "
             f"{'of peak':>8}"]
    for r in rows:
        if r["kind"] == "throughput":
            if "skipped" in r:
                lines.append(f"{r['backend']:<26} skipped: {r['skipped']}")
            else:
                lines.append(f"{r['backend']:<26} {r['tokens']:>8} {r['tok_s']:>10.0f} {r['vs_prefill']:>10.2f}x "
                             f"{r.get('init_s', 0):>8.1f} {r['achieved_flops'] / 1e9:>8.1f} "
                             f"{100 * r['fraction_of_peak']:>7.1f}%")
    peaks = {r["peak_dtype"]: r for r in rows if r["kind"] == "throughput" and "peak_dtype" in r}
    lines.append("matmul peak (torch.mm, measured first): " + ", ".join(
        f"{dt} {r['peak_flops'] / 1e9:.1f} GFLOP/s on {r['peak_threads']} threads" for dt, r in peaks.items()))
    lines += ["", f"{'storage':<8} {'bytes/token (measured)':>24} {'(formula)':>10}"]
    for r in rows:
        if r["kind"] == "storage":
            lines.append(f"{r['dtype']:<8} {r['bytes_per_token']:>24.1f} {r['formula_bytes_per_token']:>10}")
    lines += ["", f"scaling, hidden {LARGE_HIDDEN}, {LARGE_AUX} aux layers:"]
    for r in rows:
        if r["kind"] == "scaling":
            lines.append(f"  {r['tokens']:.0e} tokens: offline bf16 {_gb(r['offline_bf16_bytes'])}, fp8 "
                         f"{_gb(r['offline_fp8_bytes'])}; streaming holds <= {_gb(r['streaming_bytes'])} per consumer")
    return "\n".join(lines)
