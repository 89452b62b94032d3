"""Stage 4: `eyas eval`, the true acceptance length of a draft on held-out prompts, per domain.

The measurement itself is `eyas.acceptance.measure_acceptance` (vLLM's counters); this
stage validates the draft against the target first, prints the table and writes the report.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from eyas.acceptance import load_prompts, measure_acceptance
from eyas.config import EvalConfig, RunConfig
from eyas.draft.contract import validate_draft
from eyas.io import atomic_write_text
from eyas.models import resolve_target
from eyas.vllm_runner import is_lookup


def format_table(rep: dict[str, Any]) -> str:
    def f(x, nd=3):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"

    k = rep.get("k") or 0
    head = f"{'domain':<16}{'n':>5}{'tokens':>8}{'tok/s':>8}{'tok/step':>9}{'AL':>7}" + "".join(f"{'p' + str(i):>7}" for i in range(k))
    lines = [head, "-" * len(head)]
    rows = list(rep["domains"].items()) + [("ALL", rep | {"n": rep["n_prompts"]})]
    for name, d in rows:
        pp = d.get("per_pos") or []
        lines.append(
            f"{name[:15]:<16}{d['n']:>5}{d['generated_tokens']:>8}{f(d['tokens_per_s'], 1):>8}{f(d.get('tokens_per_step')):>9}"
            f"{f(d['acceptance_length']):>7}" + "".join(f"{f(pp[i] if i < len(pp) else None):>7}" for i in range(k))
        )
    return "\n".join(lines)


def evaluate(e: EvalConfig) -> dict[str, Any]:
    """EvalConfig -> the report (also written to e.out when set). `e.draft` "none": plain decoding."""
    if not e.draft:
        raise ValueError("eyas eval needs --draft DIR (or --draft none for the plain-decoding baseline)")
    if not e.prompts:
        raise ValueError("eyas eval needs --prompts FILE.jsonl ({'id', 'domain', 'messages'} rows)")
    target = resolve_target(e.target)
    draft = None if str(e.draft).lower() == "none" else e.draft
    if draft is not None and not is_lookup(draft):
        validate_draft(draft, target)
    prompts = load_prompts(e.prompts, e.limit)
    print(f"eyas eval: {len(prompts)} prompts, target {target}, draft {draft}, k={e.k}", file=sys.stderr)
    rep = measure_acceptance(
        target, draft, prompts, k=e.k, max_tokens=e.max_tokens, temperature=e.temperature,
        max_model_len=e.max_model_len, kv_cache_gib=e.kv_cache_gib, by_domain=e.by_domain, timeout=e.timeout,
        enforce_eager=e.eager,
    )
    if e.out:
        atomic_write_text(e.out, json.dumps(rep, indent=2) + "\n")
    return rep


def cli(e: EvalConfig, actions: list[str], run: RunConfig) -> int:
    """`eyas eval --target DIR --draft DRAFT|ngram[:MIN:MAX]|none --prompts IN.jsonl [--k 3] [--max-tokens N] [--limit N] [--out R.json]`.

    Prints a table; the last stdout line is the report as one JSON object (`acceptance_length`, ...).
    """
    if actions:
        raise ValueError(f"eyas eval takes no actions, got {actions}")
    rep = evaluate(e)
    print(format_table(rep))
    print(json.dumps(rep))
    return 0
