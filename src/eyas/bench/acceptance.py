"""Acceptance length per domain and per context length (SPEED-Bench style), from vLLM's counters.

Domains come from the held-out prompts (chat, math, code, multilingual, RAG, summarization);
context buckets are long-context prompts padded with real text (Python's own docs) to a
given number of prompt tokens, counted with the target's tokenizer and chat template.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from eyas.acceptance import measure_acceptance
from eyas.data import long_context_prompts, read_jsonl
from eyas.evaluate import format_table


def bucket_prompts(target: Path, buckets: list[int], per_bucket: int, seed: int = 0) -> list[dict[str, Any]]:
    """Long-context prompts with domain `ctx-<N>` for every bucket N (prompt tokens)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    out = []
    for rec in long_context_prompts(tok, buckets, per_bucket, seed=seed):
        n = rec["meta"]["target_tokens"]
        out.append({**rec, "domain": f"ctx-{n}"})
    return out


def domain_prompts(path: Path, per_domain: int, seed: int = 0) -> list[dict[str, Any]]:
    """Up to `per_domain` held-out prompts of each domain, ending with the first user turn."""
    rows = read_jsonl(path)
    random.Random(seed).shuffle(rows)
    by: dict[str, list] = {}
    for r in rows:
        msgs = []
        for m in r["messages"]:
            if m["role"] == "assistant":
                break
            msgs.append(m)
        if len(by.setdefault(r["domain"], [])) < per_domain and any(m["role"] == "user" for m in msgs):
            by[r["domain"]].append({"id": r["id"], "domain": r["domain"], "messages": msgs})
    return [r for d in sorted(by) for r in by[d]]


def bench_acceptance(target: Path, draft: Path, prompts: Path, buckets: list[int], per_bucket: int,
                     per_domain: int, k: int = 3, max_tokens: int = 128) -> dict[str, Any]:
    """One vLLM engine, one batch per domain / bucket; returns the eval report with `per_domain`."""
    rows = domain_prompts(prompts, per_domain) + (bucket_prompts(target, buckets, per_bucket) if buckets else [])
    max_len = max([b for b in buckets] + [2048]) + max_tokens + 64
    rep = measure_acceptance(target, draft, rows, k=k, max_tokens=max_tokens, max_model_len=max_len,
                             by_domain=True, kv_cache_gib=2.0)
    print(format_table(rep))
    return rep
