"""`eyas bench al`: acceptance per category, per input-length bucket and per position, SPEED-Bench style,
for the draft and for what needs no training (vLLM's n-gram prompt lookup) on the same prompts.

Each method runs in its own vLLM engine (`eyas.acceptance.measure_acceptance`: one batch per
category / bucket, counters diffed around each). Two figures per cell:
- AL = 1 + accepted / drafts: per *drafting* step. n-gram proposes only where it finds a match,
  so its AL is conditional on a match and flatters it;
- tokens per decode step = (generated - 1 per request) / target decode passes, every pass
  counted: the figure to compare methods by (plain decoding = 1.0).
The headline is the mean over categories (SPEED-Bench's), buckets reported beside it.
"""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path
from typing import Any

from eyas.acceptance import measure_acceptance


def bucket_label(n: int) -> str:
    return f"ctx-{n // 1024}k" if n % 1024 == 0 else f"ctx-{n}"


def bucket_prompts(target: Path, buckets: list[int], per_bucket: int, max_tokens: int,
                   seed: int = 0) -> tuple[list[dict[str, Any]], int]:
    """(prompts with domain `ctx-<N>k` per bucket N, the engine's max_model_len). A bucket past the
    target's context is filled to what fits beside `max_tokens` (its real length is in meta.tokens)."""
    from transformers import AutoConfig, AutoTokenizer

    from eyas.data import long_context_prompts

    ctx = int(getattr(AutoConfig.from_pretrained(str(target)), "max_position_embeddings", 0) or 1 << 17)
    room = ctx - max_tokens - 8
    tok = AutoTokenizer.from_pretrained(str(target))
    out = []
    for b in buckets:
        for rec in long_context_prompts(tok, [min(b, room)], per_bucket, seed=seed):
            out.append({**rec, "domain": bucket_label(b), "meta": {**rec["meta"], "bucket": b}})
    return out, min(ctx, max(buckets + [2048]) + max_tokens + 64)


def domain_prompts(path: Path, per_domain: int, seed: int = 0) -> list[dict[str, Any]]:
    """Up to `per_domain` prompts of each domain of a prompts JSONL, ending with the first user turn."""
    from eyas.bench.suite import first_turn
    from eyas.data import read_jsonl

    rows = read_jsonl(path)
    random.Random(seed).shuffle(rows)
    by: dict[str, list] = {}
    for r in rows:
        if len(by.setdefault(r["domain"], [])) < per_domain:
            by[r["domain"]].append({"id": r["id"], "domain": r["domain"], "messages": first_turn(r)})
    return [r for d in sorted(by) for r in by[d]]


def headline(rep: dict[str, Any], categories: list[str]) -> dict[str, Any]:
    """Means over categories (each category weighs the same, as in SPEED-Bench)."""
    doms = rep["domains"]
    cats = [c for c in categories if c in doms]

    def mean(key: str) -> float | None:
        xs = [doms[c][key] for c in cats if doms[c].get(key) is not None]
        return statistics.fmean(xs) if xs else None

    return {"mean_al": mean("acceptance_length"), "mean_tokens_per_decode_step": mean("tokens_per_decode_step"),
            "categories": len(cats)}


def _f(x: Any, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def format_tables(res: dict[str, Any]) -> str:
    """Markdown: per category / bucket (AL and tokens per decode step of every method), then per position."""
    methods, cats, buckets = list(res["methods"]), res["categories"], res["buckets"]
    head = ["category", "n"] + [f"{m} {w}" for m in methods for w in ("AL", "tok/step")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def row(name: str, get) -> str:
        cells = [name, str(get(methods[0]).get("n", ""))]
        for m in methods:
            d = get(m)
            cells += [_f(d.get("acceptance_length")), _f(d.get("tokens_per_decode_step"))]
        return "| " + " | ".join(cells) + " |"

    for name in cats + buckets:
        lines.append(row(name, lambda m, n=name: res["methods"][m]["domains"].get(n, {})))
    hl = {m: {"acceptance_length": h["mean_al"], "tokens_per_decode_step": h["mean_tokens_per_decode_step"],
              "n": sum(res["methods"][m]["domains"].get(c, {}).get("n", 0) for c in cats)}
          for m, h in res["headline"].items()}
    lines.append(row("**mean over categories**", lambda m: hl[m]))
    k = max(len(r.get("per_pos") or []) for r in res["methods"].values())
    lines += ["", "| method | AL | " + " | ".join(f"p{i + 1}" for i in range(k)) + " |", "|" + "---|" * (k + 2)]
    for m, r in res["methods"].items():
        pp = r.get("per_pos") or []
        lines.append(f"| {m} | {_f(r.get('acceptance_length'))} | "
                     + " | ".join(_f(pp[i] if i < len(pp) else None) for i in range(k)) + " |")
    if res.get("greedy_mismatches"):
        lines += ["", "| method | greedy replies differing from the target alone's | dtype |", "|---|---|---|"]
        lines += [f"| {m} | {g['differ']} / {g['replies']} | {g['dtype']} |" for m, g in res["greedy_mismatches"].items()]
    return "\n".join(lines)


TARGET_ALONE = "none"  # a bench.baselines entry: the target decoding alone, the reference for greedy equality


def greedy_mismatches(reports: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per method: how many replies differ from the target alone's greedy reply, token for token (the same
    prompts in the same order; lossless speculation in float32 gives 0), and the tokens generated before
    the first difference, summed. Pops the token ids from the reports (they stay out of the JSON)."""
    ref = {d: r.pop("token_ids") for d, r in reports[TARGET_ALONE]["domains"].items()}
    out = {}
    for m, rep in reports.items():
        if m == TARGET_ALONE:
            continue
        n = differ = same_prefix = 0
        for d, r in rep["domains"].items():
            for a, b in zip(r.pop("token_ids"), ref[d]):
                n += 1
                if a != b:
                    differ += 1
                    same_prefix += next(i for i, (x, y) in enumerate(zip(a + [None], b + [None])) if x != y)
        out[m] = {"replies": n, "differ": differ, "tokens_before_first_difference": same_prefix,
                  "dtype": rep.get("dtype")}
    return out


def bench_acceptance(target: Path, methods: dict[str, str], rows: list[dict[str, Any]], categories: list[str],
                     buckets: list[str], k: int = 3, max_tokens: int = 256, max_model_len: int = 2048,
                     out: Path | None = None) -> dict[str, Any]:
    """methods: {name: draft dir | ngram[:MIN:MAX]}, each run on all of `rows` ({"id", "domain", "messages"}).

    Returns {"methods": {name: measure_acceptance report}, "headline": {name: means over categories},
    "categories", "buckets", "k", "max_tokens", "table"}; with `out`, also bench_al.md and bench_al.png.
    """
    reports = {}
    for name, draft in methods.items():
        print(f"bench al: {name} ({draft}) on {len(rows)} prompts, k={k}, {max_tokens} new tokens", flush=True)
        reports[name] = measure_acceptance(target, draft, rows, k=k, max_tokens=max_tokens, max_model_len=max_model_len,
                                           by_domain=True, kv_cache_gib=2.0, return_token_ids=TARGET_ALONE in methods)
    res: dict[str, Any] = {"methods": reports, "headline": {m: headline(r, categories) for m, r in reports.items()},
                           "categories": categories, "buckets": buckets, "k": k, "max_tokens": max_tokens}
    if TARGET_ALONE in methods:
        res["greedy_mismatches"] = greedy_mismatches(reports)
    res["table"] = format_tables(res)
    print(res["table"], flush=True)
    if out is not None:
        from eyas.report import plot_suite

        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_al.md").write_text(res["table"] + "\n")
        plot_suite(res, out / "bench_al.png")
    return res


def suite_summary(info: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What the suite held, for the JSON: counts per category / bucket and the exclusion check."""
    per: dict[str, int] = {}
    for r in rows:
        per[r["domain"]] = per.get(r["domain"], 0) + 1
    return {**info, "prompts": per, "ids": [r["id"] for r in rows]}


def write_suite(rows: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
