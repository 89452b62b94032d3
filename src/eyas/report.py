"""The end-of-run report: `report.json`, `report.md` and plots (matplotlib, Agg).

Inputs are plain dicts produced by the stages (no recomputation here):
- `eval`: `eyas.acceptance.measure_acceptance`'s report: `{"acceptance_length", "k", "per_pos": [...],
  "domains": {domain: {"acceptance_length", "n", "tokens_per_s", ...}}, "tokens_per_s"}`
- `serve_eval`: `[{"step", "true_al", "est_al", "eval_seconds"}, ...]`
- `throughput`: `[{"concurrency", "baseline_tokens_per_s", "spec_tokens_per_s", "speedup"}, ...]`
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from eyas.io import atomic_write_text


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, ax, out: Path, xlabel: str, ylabel: str, title: str, legend: bool = True) -> Path:
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if legend:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_al_per_position(per_position: list[float], out: Path, k: int | None = None) -> Path:
    """Bar plot of the acceptance rate at each draft position (accepted_i / drafts)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    xs = list(range(1, len(per_position) + 1))
    ax.bar(xs, per_position, color="#3b6ea5")
    ax.set_ylim(0, 1)
    ax.set_xticks(xs)
    title = "vLLM acceptance per position" + (f" (k={k})" if k else "")
    return _save(fig, ax, out, "draft position", "acceptance rate", title, legend=False)


def plot_al_over_training(records: list[dict[str, Any]], out: Path, ngram_tokens_per_step: float | None = None) -> Path:
    """Per checkpoint step: the served AL (vLLM, held-out prompts), the simulated AL on held-out features
    (train.holdout) and, faint, the trainer's estimate on its own training batches (optimistic by
    construction); n-gram lookup's tokens per step on the same prompts as the bar to beat."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    steps = [r["step"] for r in records]

    def col(key: str) -> list[float]:
        return [r[key] if r.get(key) is not None else float("nan") for r in records]

    ax.plot(steps, col("true_al"), "o-", label="served AL (vLLM, held-out prompts)")
    if any(r.get("sim_al") is not None for r in records):
        ax.plot(steps, col("sim_al"), "^-", label="simulated AL (held-out features)")
    ax.plot(steps, col("est_al"), "s:", color="lightgray", label="trainer's estimate (training batches)")
    if ngram_tokens_per_step:
        ax.axhline(ngram_tokens_per_step, color="gray", linestyle="--", label="n-gram lookup (tokens/step)")
    return _save(fig, ax, out, "training step", "acceptance length", "Serve-in-the-loop evaluation")


def plot_throughput(rows: list[dict[str, Any]], out: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    conc = [r["concurrency"] for r in rows]
    ax.plot(conc, [r["baseline_tokens_per_s"] for r in rows], "o-", label="target alone")
    ax.plot(conc, [r["spec_tokens_per_s"] for r in rows], "s-", label="target + EAGLE-3 draft")
    for m in _baselines(rows):  # no-training proposers measured beside the draft (bench.baselines)
        label = "target + draft with lookup (hybrid)" if m.startswith("hybrid") else f"target + {m} lookup"
        ax.plot(conc, [r.get(f"{m}_tokens_per_s", float("nan")) for r in rows], "^--", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(conc)
    ax.set_xticklabels([str(c) for c in conc])
    return _save(fig, ax, out, "concurrency", "output tokens/s", "Throughput vs concurrency")


def _baselines(rows: list[dict[str, Any]]) -> list[str]:
    return sorted({k[: -len("_tokens_per_s")] for r in rows for k in r
                   if k.endswith("_tokens_per_s") and k not in ("baseline_tokens_per_s", "spec_tokens_per_s")})


def plot_learning_curve(points: list[tuple[int, float]], fit: tuple[float, float], ngram_tokens_per_step: float | None,
                        out: Path) -> Path:
    """True AL against generated tokens trained on (log x), the fit a + b·ln(tokens) past the last point,
    and n-gram lookup's tokens per step on the same prompts as a line."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    xs = [t for t, _ in points]
    ax.plot(xs, [al for _, al in points], "o", label="true AL (vLLM), held-out prompts")
    lo, hi = min(xs), max(xs) * 4
    grid = [lo * (hi / lo) ** (i / 40) for i in range(41)]
    ax.plot(grid, [fit[0] + fit[1] * math.log(x) for x in grid], "--", label="fit a + b ln(tokens)")
    if ngram_tokens_per_step:
        ax.axhline(ngram_tokens_per_step, color="gray", linestyle=":", label="n-gram lookup (tokens/step)")
    ax.set_xscale("log")
    return _save(fig, ax, out, "generated tokens trained on", "acceptance length", "Learning curve")


def plot_suite(res: dict[str, Any], out: Path) -> Path:
    """Tokens per decode step (bars) of every method per suite category and input-length bucket."""
    plt = _plt()
    names = list(res["categories"]) + list(res["buckets"])
    methods = list(res["methods"])
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(names) * max(1, len(methods))), 3.6))
    w = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        doms = res["methods"][m]["domains"]
        ys = [(doms.get(n) or {}).get("tokens_per_decode_step") or 0.0 for n in names]
        ax.bar([j + i * w for j in range(len(names))], ys, w, label=m)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks([j + w * (len(methods) - 1) / 2 for j in range(len(names))])
    ax.set_xticklabels(names, rotation=35, ha="right")
    return _save(fig, ax, out, "", "tokens per decode step", f"Acceptance suite (k={res['k']})")


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:.3f}"


def _md_table(header: list[str], rows: list[list[Any]]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_report(out_dir: Path, report: dict[str, Any]) -> dict[str, Path]:
    """Write report.json, report.md and the plots that the data allows."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    ev, se, tp = report.get("eval") or {}, report.get("serve_eval") or [], report.get("throughput") or []
    se = [r for r in se if r.get("true_al") is not None]
    per_pos = ev.get("per_pos") or []
    per_domain = {d: v.get("acceptance_length") for d, v in (ev.get("domains") or {}).items()}
    if per_pos:
        paths["al_per_position"] = plot_al_per_position(per_pos, out_dir / "al_per_position.png", ev.get("k"))
    if se:
        paths["al_over_training"] = plot_al_over_training(se, out_dir / "al_over_training.png",
                                                          (report.get("eval_ngram") or {}).get("tokens_per_step"))
    if tp:
        paths["throughput"] = plot_throughput(tp, out_dir / "throughput.png")
    report = {**report, "plots": {k: str(v.name) for k, v in paths.items()}}
    atomic_write_text(out_dir / "report.json", json.dumps(report, indent=2, default=str) + "\n")

    md = [f"# eyas run report: {report.get('name', '')}", ""]
    ng = report.get("eval_ngram") or {}
    if ev:
        md += [f"**Acceptance length (vLLM, k={ev.get('k')}, greedy, held-out prompts): "
               f"{ev.get('acceptance_length', float('nan')):.3f}**", ""]
        sx = report.get("eval_suffix") or {}
        if ng:
            md += [f"Tokens per target step: draft {_num(ev.get('tokens_per_step'))}, vLLM's n-gram lookup on the "
                   f"same prompts {_num(ng.get('tokens_per_step'))}"
                   + (f", suffix decoding {_num(sx.get('tokens_per_step'))}" if sx else "")
                   + " (no training: the bar a draft has to beat)", ""]
        if per_domain:
            doms = ev.get("domains") or {}
            base = {"n-gram": ng.get("domains") or {}, **({"suffix": sx.get("domains") or {}} if sx else {})}
            lk = report.get("lookup") or {}
            if lk.get("exported", "none") != "none" and (lk.get("domains") or {}).get(lk["exported"]):
                base = {f"draft + {lk['exported']}": {d: {"tokens_per_step": v}
                                                      for d, v in lk["domains"][lk["exported"]].items()}, **base}
            md += [_md_table(["domain", "AL", "tokens/step"] + [f"{b} tokens/step" for b in base],
                             [[d, v, _num(doms[d].get("tokens_per_step"))]
                              + [_num((bd.get(d) or {}).get("tokens_per_step")) for bd in base.values()]
                              for d, v in sorted(per_domain.items())]), ""]
        if per_pos:
            md += [_md_table(["position", "acceptance rate"], [[i + 1, v] for i, v in enumerate(per_pos)]), ""]
    lk = report.get("lookup") or {}
    if lk:
        src = lk.get("sources") or {}
        md += ["## The draft with prompt lookup beside it (one server, eyas.hybrid_serve)", "",
               f"Exported policy: **{lk.get('exported')}** (best {lk.get('best')}: "
               f"{_num(lk['candidates'].get(lk.get('best')))} tokens per target step against the draft alone's "
               f"{_num(lk.get('draft_alone'))}, {100 * (lk.get('gain') or 0):+.1f}%)", "",
               _md_table(["policy", "tokens/step", "lookup steps", "lookup accepted", "draft steps", "draft accepted"],
                         [[spec, t, *[((src.get(spec) or {}).get(s_) or {}).get(x, "-")
                                      for s_ in ("lookup", "draft") for x in ("steps", "accepted")]]
                          for spec, t in lk["candidates"].items()]), ""]
    tr = report.get("train") or {}
    if tr.get("step"):
        bud = tr.get("budget") or {}
        md += [f"Training: {tr['step']} steps; this run {tr.get('steps_run')} of them, {tr.get('tokens', 0):,} tokens in "
               f"{tr.get('steps_s') or 0:.0f} s of steps (saves and serve-evals apart)"
               + (f"; train.max_minutes {bud['minutes']:g} fitted {bud['fitted_steps']} of the {bud['max_steps']} steps "
                  f"asked at {bud['per_step_s']} s/step" if bud else ""), ""]
    if se:
        md += ["## Serve-in-the-loop", "", _md_table(
            ["step", "served AL (vLLM)", "simulated AL (held-out features)", "trainer's estimate (training batches)",
             "eval s"],
            [[r["step"], r["true_al"], _num(r.get("sim_al")), r["est_al"], r.get("eval_seconds", "")] for r in se]), ""]
    if tp:
        extra = _baselines(tp)
        md += ["## Throughput", "", _md_table(
            ["concurrency", "target tok/s", "draft tok/s", "draft speedup"] + [f"{m} speedup" for m in extra],
            [[r["concurrency"], r["baseline_tokens_per_s"], r["spec_tokens_per_s"], r["speedup"]]
             + [r.get(f"{m}_speedup", "-") for m in extra] for r in tp]), ""]
    if report.get("timings"):
        md += ["## Stage timings (s)", "", _md_table(["stage", "seconds"], [[k, v] for k, v in report["timings"].items()]), ""]
    if report.get("serve_command"):
        md += ["## Deploy", "", "```bash", report["serve_command"], "```", ""]
    md += [f"![{k}]({v.name})" for k, v in paths.items()]
    atomic_write_text(out_dir / "report.md", "\n".join(md) + "\n")
    return {"json": out_dir / "report.json", "md": out_dir / "report.md", **paths}
