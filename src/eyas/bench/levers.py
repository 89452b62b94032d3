"""`eyas bench levers`: an ablation table, each training lever against the same baseline.

Every row trains the recipe's `train` section (same features, same steps, same holdout) with
its overrides applied, and is measured the way a user measures a draft: the trainer's last
checkpoint is exported and served by vLLM on the held-out prompts (`eval.prompts`, all of
them, `eval.k`), beside its simulated AL on the held-out feature samples (`train.holdout`).
An n-gram row (vLLM's prompt lookup, no training) is served on the same prompts.

A lever is `NAME: section.key=value, section.key=value` (`bench.levers`, one string each);
the baseline row (the recipe as is) comes first. Rows run one after another under
`bench.out/levers/NAME` and a finished row is read back, so a stopped table resumes.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

from eyas.acceptance import load_prompts
from eyas.config import Recipe, apply_override, finalize
from eyas.evaluate import evaluate
from eyas.io import atomic_write_text
from eyas.manifest import read_manifest
from eyas.serve_eval import on_checkpoint, read_records, train_with_serve_eval

BASELINE = "baseline"


def parse_lever(text: str) -> tuple[str, list[str]]:
    """`NAME: a.b=1, c.d=x` -> ("NAME", ["a.b=1", "c.d=x"])."""
    name, sep, rest = text.partition(":")
    name = name.strip()
    overrides = [o.strip() for o in rest.split(",") if o.strip()] if sep else []
    if not name or not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ValueError(f"bench.levers entry {text!r}: write 'NAME: section.key=value, ...' with a plain NAME")
    if not overrides and name != BASELINE:
        raise ValueError(f"bench.levers entry {text!r} changes nothing: add section.key=value overrides after 'NAME:'")
    return name, overrides


def row_recipe(cfg: Recipe, overrides: list[str], out: Path) -> Recipe:
    """The recipe for one row: the base recipe with `overrides`, training into `out`, evaluated once at
    the end on every held-out prompt."""
    row = copy.deepcopy(cfg)
    for ov in overrides:
        apply_override(row, ov)
    row.train.out = str(out)
    row.train.eval_every = 0
    row.train.eval_limit = 0
    return finalize(row)


def draft_params(draft: Path) -> int:
    """Weights the draft computes with per proposed token (embed_tokens and the vocab maps left out)."""
    from safetensors import safe_open

    with safe_open(str(draft / "model.safetensors"), framework="pt") as f:
        names = [n for n in f.keys() if not n.endswith(("embed_tokens.weight", "d2t", "t2d"))]
        return sum(math.prod(f.get_slice(n).get_shape()) for n in names)


def run_row(cfg: Recipe, name: str, overrides: list[str], root: Path) -> dict[str, Any]:
    """Train (or read back) one row; returns its record."""
    out = root / name
    row_file = out / "row.json"
    if row_file.exists():
        done = json.loads(row_file.read_text())
        if done.get("overrides") != overrides:
            raise ValueError(f"{out} holds lever {name!r} with overrides {done.get('overrides')}, not {overrides}: "
                             "rename the lever or remove that directory")
        print(f"bench levers: {name}: read back from {row_file}", file=sys.stderr)
        return done
    r = row_recipe(cfg, overrides, out / "train")
    r.train.resume = True  # a row stopped part way continues from its last checkpoint
    summary = train_with_serve_eval(r.train, r.eval)
    recs = [x for x in read_records(out / "train") if x["step"] == summary["step"]]
    if not recs:  # stopped after training, before vLLM measured it
        prompts = load_prompts(r.eval.prompts)
        recs = [on_checkpoint(out / "train", summary["checkpoint"], summary["step"], r.eval, prompts,
                              target=r.train.target)]
    rec = recs[-1]
    source = (read_manifest(out / "train") or {}).get("source") or {}
    if rec.get("true_al") is None:
        raise RuntimeError(f"bench levers: {name}: vLLM did not measure the draft ({rec.get('log')})")
    row = {
        "name": name, "overrides": overrides, "steps": summary["step"],
        "seconds_per_step": _train_seconds_per_step(summary, rec),
        "samples": source.get("samples"), "generated_tokens": source.get("generated_tokens"),
        "true_al": rec["true_al"], "tokens_per_step": rec.get("tokens_per_step"), "per_pos": rec["per_pos"],
        "domains": rec["domains"],
        "sim_al": rec.get("sim_al"), "sim_per_pos": rec.get("sim_per_pos"),
        "draft": rec["draft"], "draft_params": draft_params(Path(rec["draft"])),
    }
    atomic_write_text(row_file, json.dumps(row, indent=2) + "\n")
    return row


def _train_seconds_per_step(summary: dict[str, Any], rec: dict[str, Any]) -> float | None:
    """The trainer's wall time per step it ran in this call, less the serve-eval it waited for; None
    when this call did not train (the row was already trained, or only re-measured)."""
    steps = summary.get("steps_run")  # absent when the trainer found the row finished
    if not steps:
        return None
    return (summary["elapsed_s"] - rec["eval_seconds"] - rec["export_seconds"]) / steps


def ngram_row(cfg: Recipe, root: Path) -> dict[str, Any]:
    """vLLM's n-gram prompt lookup on the same prompts, with the same k."""
    f = root / "ngram.json"
    if f.exists():
        return json.loads(f.read_text())
    rep = evaluate(dataclasses.replace(cfg.eval, draft="ngram", limit=0, out=""))  # the eval stage's own settings
    row = {"name": "ngram", "overrides": [], "true_al": rep["acceptance_length"], "per_pos": rep["per_pos"],
           "tokens_per_step": rep["tokens_per_step"],
           "domains": {d: v["acceptance_length"] for d, v in rep["domains"].items()}}
    atomic_write_text(f, json.dumps(row, indent=2) + "\n")
    return row


def _f(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(rows: list[dict[str, Any]]) -> str:
    """AL: vLLM's, per drafting step; tok/step: tokens per target forward (n-gram drafts only on a match)."""
    base = next((r for r in rows if r["name"] == BASELINE), None)
    head = (f"{'lever':<14}{'AL (vLLM)':>10}{'Δ':>8}{'tok/step':>9}{'sim AL':>8}{'gen tokens':>11}{'s/step':>8}"
            f"{'draft params':>14}  overrides")
    lines = [head, "-" * len(head)]
    for r in rows:
        delta = r["true_al"] - base["true_al"] if base and r["name"] not in ("ngram", BASELINE) else None
        lines.append(
            f"{r['name'][:13]:<14}{r['true_al']:>10.3f}{_f(delta, '+.3f'):>8}{_f(r.get('tokens_per_step'), '.3f'):>9}"
            f"{_f(r.get('sim_al'), '.3f'):>8}{_f(r.get('generated_tokens'), ','):>11}"
            f"{_f(r.get('seconds_per_step'), '.2f'):>8}{_f(r.get('draft_params'), ','):>14}  {' '.join(r['overrides'])}"
        )
    return "\n".join(lines)


def bench_levers(cfg: Recipe, levers: list[str], out: Path) -> dict[str, Any]:
    if not cfg.train.features:
        raise ValueError("eyas bench levers needs train.features (the feature dir every row trains on)")
    if not cfg.eval.prompts:
        raise ValueError("eyas bench levers needs eval.prompts (the held-out prompts vLLM serves)")
    parsed = [parse_lever(x) for x in [BASELINE] + [x for x in levers if parse_lever(x)[0] != BASELINE]]
    names = [n for n, _ in parsed]
    if len(set(names)) != len(names):
        raise ValueError(f"bench.levers: lever names repeat: {names}")
    root = out / "levers"
    rows = [ngram_row(cfg, root)]
    for name, overrides in parsed:
        rows.append(run_row(cfg, name, overrides, root))
        print(format_table(rows), file=sys.stderr, flush=True)
    table = format_table(rows)
    print(table)
    return {"rows": rows, "table": table, "features": cfg.train.features, "prompts": cfg.eval.prompts,
            "k": cfg.eval.k, "holdout": cfg.train.holdout}
