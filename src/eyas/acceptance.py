"""True acceptance length from vLLM's own spec-decode counters: the one measurement every
stage that proves a draft uses (export --verify, serve-eval, eval, benchmarks).

`measure_acceptance` runs the target with the draft in a fresh vLLM process
(`eyas.vllm_runner`), greedy, through `LLM.chat` (the target's chat template), one
batch per domain in the same engine, and diffs the counters around each batch:

    AL = 1 + num_accepted_tokens / num_drafts      (bonus token counted; plain decoding = 1.0)
    per_pos[i] = accepted_per_pos[i] / num_drafts  (how often draft position i is accepted)
    al_at_k[j] = 1 + sum(per_pos[:j+1])             (the AL a k = j+1 draft would have had)

With `draft=None` the same run is plain decoding: the tokens/s baseline.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from eyas import vllm_runner
from eyas.children import scratch_prefix
from eyas.chat import load_chat_template, load_tokenizer, render_prompt_ids, validate_messages
from eyas.host import engine_dtype, machine
from eyas.io import iter_jsonl
from eyas.vllm_runner import COUNTERS, PER_POS, is_lookup, is_ngram, ngram_lengths


def load_prompts(path: str | os.PathLike, limit: int = 0) -> list[dict[str, Any]]:
    """`{"id", "domain", "messages"}` JSONL; trailing assistant turns are dropped (the target answers)."""
    p = Path(path)
    rows = []
    for n, row in iter_jsonl(p, "the prompts file"):
        msgs = list(row.get("messages") or [])
        while msgs and msgs[-1].get("role") == "assistant":
            msgs.pop()
        validate_messages(msgs, f"{p}:{n}")
        rows.append({"id": row.get("id", f"{p.stem}-{n}"), "domain": row.get("domain") or "all", "messages": msgs})
        if limit and len(rows) >= limit:
            break
    if not rows:
        raise ValueError(f"{p}: no prompts")
    return rows


def _fit(prompts: list[dict[str, Any]], target: Path, max_model_len: int, max_tokens: int) -> tuple[list, int]:
    """Drop prompts whose rendered length leaves no room for max_tokens (vLLM would refuse the batch)."""
    tok = load_tokenizer(target)
    tpl = load_chat_template(target, tok=tok)
    keep = [p for p in prompts if len(render_prompt_ids(tok, p["messages"], tpl)) + max_tokens <= max_model_len]
    return keep, len(prompts) - len(keep)


def summarize(counters: dict[str, Any], k: int | None) -> dict[str, Any]:
    """AL and per-position rates from raw counts (divide once, here)."""
    drafts = int(counters.get("num_drafts", 0))
    acc = int(counters.get("num_accepted_tokens", 0))
    per_pos_counts = list(counters.get("accepted_per_pos") or [])
    out: dict[str, Any] = {
        "num_drafts": drafts,
        "num_draft_tokens": int(counters.get("num_draft_tokens", 0)),
        "num_accepted_tokens": acc,
        "accepted_per_pos": per_pos_counts,
    }
    if drafts:
        out["acceptance_length"] = 1.0 + acc / drafts
        out["per_pos"] = [c / drafts for c in per_pos_counts]
        al, run = [], 1.0
        for r in out["per_pos"]:
            run += r
            al.append(run)
        out["al_at_k"] = al
        out["draft_acceptance_rate"] = acc / out["num_draft_tokens"] if out["num_draft_tokens"] else None
    else:
        out["acceptance_length"] = 1.0 if k is None else None
        out["per_pos"] = []
        out["al_at_k"] = []
    return out


def tokens_per_step(generated: int, counters: dict[str, Any]) -> float | None:
    """Tokens each target forward pass made, prefill included: every step emits 1 + its accepted
    tokens. Unlike AL (per drafting step) it counts the steps where nothing was proposed, which is
    how n-gram lookup and a draft compare on equal terms (n-gram proposes only on a match). Exact
    but for each request's last step, whose accepted tokens past max_tokens vLLM drops."""
    steps = generated - int(counters.get("num_accepted_tokens", 0))
    return generated / steps if generated and steps > 0 else None


def tokens_per_decode_step(generated: int, n_requests: int, counters: dict[str, Any]) -> float | None:
    """Tokens per target decode step: (generated - one prefill token per request) / decode forward passes,
    every pass counted (a pass emits 1 + its accepted tokens). Plain decoding = 1.0 exactly; this is the
    figure that compares methods whose proposers skip steps (n-gram lookup proposes only on a match)."""
    decoded = generated - n_requests
    steps = decoded - int(counters.get("num_accepted_tokens", 0))
    return decoded / steps if decoded > 0 and steps > 0 else None


def counters_from_prometheus(text: str) -> dict[str, Any]:
    """Spec-decode counters from a server's `/metrics` text (summed over label sets)."""
    out: dict[str, Any] = {}
    per_pos: dict[int, int] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:spec_decode_"):
            continue
        metric, _, value = line.rpartition(" ")
        name, _, labels = metric.partition("{")
        name = name.removesuffix("_total")
        if name in COUNTERS:
            out[COUNTERS[name]] = out.get(COUNTERS[name], 0) + int(float(value))
        elif name == PER_POS:
            pos = int(labels.split('position="', 1)[1].split('"', 1)[0])
            per_pos[pos] = per_pos.get(pos, 0) + int(float(value))
    if per_pos:
        out["accepted_per_pos"] = [per_pos.get(i, 0) for i in range(max(per_pos) + 1)]
    return out


def measure_acceptance(
    target: str | os.PathLike,
    draft: str | os.PathLike | None,
    prompts: list[dict[str, Any]],
    k: int = 3,
    max_tokens: int = 128,
    temperature: float = 0.0,
    max_model_len: int = 2048,
    kv_cache_gib: float = 2.0,
    by_domain: bool = True,
    timeout: float = 3600,
    log_path: str | os.PathLike | None = None,
    return_texts: bool = False,
    return_token_ids: bool = False,
    enforce_eager: bool = True,
    gpu_memory_utilization: float | None = None,
) -> dict[str, Any]:
    """Run vLLM speculative decoding (or plain decoding, draft=None) on `prompts`; returns the report.

    prompts: `{"id", "domain", "messages"}` dicts (messages end with a user turn).
    """
    target = Path(target)
    draft = None if draft in (None, "", "none") else str(draft)
    if is_ngram(draft):
        ngram_lengths(draft)  # a bad ngram:MIN:MAX fails here, before vLLM starts
    prompts, skipped = _fit(prompts, target, max_model_len, max_tokens)
    if not prompts:
        raise ValueError(f"no prompt fits max_model_len {max_model_len} with max_tokens {max_tokens}")
    groups: OrderedDict[str, list] = OrderedDict()
    for p in prompts:
        groups.setdefault(p["domain"] if by_domain else "all", []).append(p["messages"])
    spec = {
        "target": str(target),
        "draft": draft,
        "k": int(k),
        "max_tokens": int(max_tokens),
        "temperature": float(temperature),
        "max_model_len": int(max_model_len),
        "kv_cache_gib": kv_cache_gib,
        "enforce_eager": enforce_eager,
        "return_texts": return_texts,
        "return_token_ids": return_token_ids,  # each reply's ids per domain: greedy equality checks
        "gpu_memory_utilization": gpu_memory_utilization,  # on GPU beside a trainer: leave it room
        "batches": [{"name": d, "conversations": c} for d, c in groups.items()],
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=scratch_prefix("hybrid")) as tmp:
        env = {"EYAS_HYBRID_STATS": str(Path(tmp) / "hybrid.json")} if _lookup_policy(draft) else None
        res = vllm_runner.run(spec, timeout=timeout, log_path=log_path, env=env)
    wall = time.perf_counter() - t0
    kk = int(k) if draft else None

    total = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    domains, gen, secs = {}, 0, 0.0
    for b in res["batches"]:
        c = b["counters"]
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            total[key] += int(c.get(key, 0))
        pp = c.get("accepted_per_pos") or []
        total["accepted_per_pos"] = [a + b_ for a, b_ in zip(total["accepted_per_pos"] or [0] * len(pp), pp)]
        gen += b["generated_tokens"]
        secs += b["seconds"]
        domains[b["name"]] = {
            "n": b["n"],
            "generated_tokens": b["generated_tokens"],
            "tokens_per_step": tokens_per_step(b["generated_tokens"], c),
            "tokens_per_decode_step": tokens_per_decode_step(b["generated_tokens"], b["n"], c),
            "seconds": b["seconds"],
            "tokens_per_s": b["generated_tokens"] / b["seconds"] if b["seconds"] else None,
            **summarize(c, kk),
        }
        if return_texts:
            domains[b["name"]]["texts"] = b["texts"]
        if return_token_ids:
            domains[b["name"]]["token_ids"] = b["token_ids"]
        if "hybrid" in b:
            domains[b["name"]]["hybrid"] = b["hybrid"]
    consistent = not draft or total["num_draft_tokens"] == total["num_drafts"] * int(k)
    if not consistent and draft != vllm_runner.SUFFIX:  # suffix decoding proposes as many as its tree supports  # vLLM proposed fewer than k tokens in some steps: AL is still 1 + accepted / drafts
        print(f"eyas eval: warning: {total['num_draft_tokens']} draft tokens for {total['num_drafts']} drafts "
              f"at k={k}", file=sys.stderr)
    return {
        "target": str(target),
        "draft": draft,
        "machine": machine(),
        "dtype": engine_dtype(None if is_lookup(draft) else draft),
        "k": kk,
        "n_prompts": len(prompts),
        "skipped_too_long": skipped,
        "max_tokens": max_tokens,
        "generated_tokens": gen,
        "tokens_per_step": tokens_per_step(gen, total),
        "tokens_per_decode_step": tokens_per_decode_step(gen, sum(b["n"] for b in res["batches"]), total),
        "decode_seconds": secs,
        "tokens_per_s": gen / secs if secs else None,
        "load_seconds": res["load_seconds"],
        "wall_seconds": wall,
        "counters_consistent": consistent,  # num_draft_tokens == k * num_drafts
        **summarize(total, kk),
        **({"hybrid": _sum_hybrid(domains.values())} if any("hybrid" in d for d in domains.values()) else {}),
        "domains": domains,
    }


def _lookup_policy(draft: str | None) -> dict[str, Any] | None:
    """The prompt-lookup policy an exported draft's config.json names (eyas.hybrid_serve), or None."""
    if not draft or is_lookup(draft) or not (Path(draft) / "config.json").exists():
        return None
    return json.loads((Path(draft) / "config.json").read_text()).get("eyas_lookup")


def _sum_hybrid(domains) -> dict[str, dict[str, int]]:
    """Per-source steps and accepted tokens over every domain's batch: which proposer paid."""
    out = {s: {"steps": 0, "accepted": 0} for s in ("draft", "lookup")}
    for d in domains:
        for s, c in (d.get("hybrid") or {}).items():
            for x, v in c.items():
                out[s][x] += v
    return out
