"""Training metrics: raw counts summed over micro-batches and ranks, divided once.

Per TTT position i: ce_i (soft cross-entropy), kl_i (ce_i minus the labels' entropy: what
training can still remove), acc_i = correct_i / scored_i (draft top-1 == target top-1, over
the micro-batches whose target top-1 was computed: every `train.score_every`-th one),
cond_acc_i = cond_num_i / cond_den_i (the same among rows whose positions 0..i-1 were all
right), est_al = 1 + Σ_k Π_{j<=k} acc_j (the estimate the trainer reports and passes to
serve-eval), est_al_chain = 1 + Σ_k Π_{j<=k} cond_acc_j (the fraction of chains accepted
through k: closer to what greedy verification accepts). Written to stdout, RUN/metrics.jsonl
and TensorBoard (RUN/tb) by rank 0.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

from eyas.io import append_jsonl, scan_jsonl, write_jsonl


def _div(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    return [float(x) / float(y) if float(y) > 0 else 0.0 for x, y in zip(a.tolist(), b.tolist())]


def est_al(acc: list[float]) -> float:
    total, run = 1.0, 1.0
    for a in acc:
        run *= a
        total += run
    return total


def summarize(stats: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Raw per-position counts -> rates (lists over TTT positions) and AL estimates."""
    acc = _div(stats["correct"], stats["scored"])
    cond = _div(stats["cond_num"], stats["cond_den"])
    return {
        "acc": acc,
        "cond_acc": cond,
        "est_al": est_al(acc),
        "est_al_chain": est_al(cond),
        "ce": _div(stats["loss_sum"], stats["rows"]),
        "kl": _div(stats["loss_sum"] - stats["ent_sum"], stats["rows"]),
        "in_vocab": _div(stats["in_vocab"], stats["scored"]),
        "loss_tokens": int(stats["rows"][0].item()),
    }


class MetricsLogger:
    """stdout + metrics.jsonl + TensorBoard on rank 0; no-op elsewhere."""

    def __init__(self, run_dir: str | os.PathLike, enabled: bool, resume_step: int = 0):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():  # drop records past the step we resume from (logged after that checkpoint)
            keep = [r for r in scan_jsonl(self.path, "eyas train") if r.get("step", 0) <= resume_step]
            write_jsonl(self.path, keep)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=resume_step + 1 if resume_step else None)
        except Exception as e:  # tensorboard missing or broken: the JSONL still has everything
            print(f"eyas train: TensorBoard disabled ({e})", file=sys.stderr)

    def last(self, key: str) -> Any:
        """The last value of `key` logged so far (None when never)."""
        if not self.enabled:
            return None
        return next((r[key] for r in reversed(scan_jsonl(self.path, "eyas train")) if key in r), None)

    def log(self, rec: dict[str, Any], echo: bool = True) -> None:
        if not self.enabled:
            return
        append_jsonl(self.path, [rec])
        if self.tb is not None:
            step = rec["step"]
            for k, v in rec.items():
                if k == "step":
                    continue
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(f"train/{k}", v, step)
                elif isinstance(v, list) and v and isinstance(v[0], (int, float)):
                    for i, x in enumerate(v):
                        self.tb.add_scalar(f"train/{k}/{i}", x, step)
            self.tb.flush()
        if echo:
            print(format_line(rec), flush=True)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def format_line(rec: dict[str, Any]) -> str:
    """One log record as the console line (`eyas train` echo and progress bar)."""
    acc = " ".join(f"{a:.2f}" for a in rec.get("acc", []))
    return (f"step {rec['step']:>6} loss {rec['loss']:.4f} acc [{acc}] est_al {rec.get('est_al', 0):.3f} "
            f"lr {rec.get('lr', 0):.2e} gnorm {rec.get('grad_norm', 0):.3f} {rec.get('tokens_per_s', 0):.0f} tok/s")
