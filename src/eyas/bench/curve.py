"""`eyas bench curve`: the learning curve, true AL against the generated tokens trained on.

Each point trains the recipe's `train` section on a nested subset of the features
(`train.max_samples` = each of `bench.curve_samples`, 0 = all; the same held-out samples; the
same steps, or with `bench.curve_steps` one step count per point, to scale steps with data)
and is served by vLLM on the held-out prompts, as `eyas bench levers` rows are. A
fit AL = a + b·ln(tokens) over the points gives the generated tokens it predicts for AL
2.0, 2.5 and 3.0: an extrapolation, printed with the range it was fitted on. The plot
(`learning_curve.png`) carries vLLM's n-gram lookup on the same prompts as a line.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

from eyas.bench.levers import ngram_row, run_row
from eyas.config import Recipe
from eyas.report import plot_learning_curve

AIMS = (2.0, 2.5, 3.0)


def fit_log(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares AL = a + b·ln(tokens) over (tokens, AL) points -> (a, b)."""
    xs = [math.log(t) for t, _ in points]
    ys = [al for _, al in points]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if n < 2 or sxx == 0:
        raise ValueError("a learning curve needs at least two different data sizes (bench.curve_samples)")
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def predict_tokens(a: float, b: float, al: float) -> float | None:
    """Generated tokens at which the fit reaches `al` (None when the fit does not rise)."""
    return math.exp((al - a) / b) if b > 0 else None


def bench_curve(cfg: Recipe, samples: list[int], out: Path, steps: list[int] | None = None) -> dict[str, Any]:
    """samples: train.max_samples per point (0 = all); steps: train.max_steps per point (None / []: train's)."""
    if not cfg.train.features or not cfg.eval.prompts:
        raise ValueError("eyas bench curve needs train.features and eval.prompts (as bench levers does)")
    if len(set(samples)) < 2:
        raise ValueError(f"bench.curve_samples needs two or more sizes (0 = all), got {samples}")
    if steps and (len(steps) != len(samples) or min(steps) < 1):
        raise ValueError(f"bench.curve_steps needs one positive step count per bench.curve_samples entry "
                         f"({len(samples)}), got {steps}")
    root = out / "curve"
    cfg = copy.deepcopy(cfg)
    cfg.train.max_minutes = 0  # every point its full step count: a time budget would cut the slow points short
    ngram = ngram_row(cfg, root)
    rows = [run_row(cfg, (f"n{m}" if m else "all") + (f"_s{s}" if s else ""),
                    [f"train.max_samples={m}"] + ([f"train.max_steps={s}"] if s else []), root)
            for m, s in zip(samples, steps or [0] * len(samples))]  # s = 0: the recipe's train.max_steps
    rows.sort(key=lambda r: r["generated_tokens"])
    a, b = fit_log([(r["generated_tokens"], r["true_al"]) for r in rows])
    predicted = {str(al): predict_tokens(a, b, al) for al in AIMS}
    plot = plot_learning_curve([(r["generated_tokens"], r["true_al"]) for r in rows], (a, b),
                               ngram.get("tokens_per_step"), out / "learning_curve.png")
    span = f"{rows[0]['generated_tokens']:,}-{rows[-1]['generated_tokens']:,}"
    print(f"{'samples':>8}{'gen tokens':>12}{'steps':>7}{'AL (vLLM)':>11}{'tok/step':>10}{'sim AL':>8}")
    for r in rows:
        print(f"{r['samples']:>8}{r['generated_tokens']:>12,}{r['steps']:>7}{r['true_al']:>11.3f}"
              f"{r.get('tokens_per_step') or float('nan'):>10.3f}{r.get('sim_al') or float('nan'):>8.3f}")
    print(f"n-gram lookup on the same prompts: {ngram['tokens_per_step']:.3f} tokens/step (AL {ngram['true_al']:.3f})")
    print(f"fit AL = {a:.3f} + {b:.3f} ln(tokens) over {span} generated tokens; extrapolated tokens for "
          + ", ".join(f"AL {al}: {'never' if t is None else f'{t:.2g}'}" for al, t in predicted.items()))
    return {"rows": rows, "ngram": ngram, "fit": {"a": a, "b": b, "fitted_on": span}, "predicted_tokens": predicted,
            "plot": str(plot)}
