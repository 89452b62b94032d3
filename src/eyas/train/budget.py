"""`train.max_minutes`: a wall-clock budget for the optimizer steps, sized to the machine they run on.

The demo's step took ~1.5 s on the AVX-512 EPYC and (derived) ~3 s on the AVX2 one, so a step count
alone cannot promise a time. With a budget the trainer times its first steps (the first `skip` are set-up and not
counted), takes the slowest rank's mean seconds per step, and trains min(max_steps, the steps that fit
in what is left of the budget); the cosine horizon follows the fitted count (unless
`train.lr_decay_steps` fixes it), so the run still ends at its minimum lr. Checkpoint saves and
serve-evals are outside the budget: they measure the run, they do not train it. The fitted count is
kept in the run's manifest, so a resume finishes the same run rather than fitting again (to train past
it, resume with `train.max_minutes=0` and the `max_steps` wanted; `train.lr_decay_steps` sets a new
horizon). A run killed before its fit times its steps afresh when resumed.

`run.max_minutes` budgets a whole `eyas run`: when training starts, it gets what is left of the run's
minutes less `run.reserve_minutes` (kept for export, eval and bench), at most its own `train.max_minutes`.
Synthesis keeps its own budget (`synth.max_seconds`); a machine that synthesizes slower trains fewer steps.
"""

from __future__ import annotations

from typing import Any


def resumed_max_steps(max_steps: int, max_minutes: float, manifest: dict[str, Any]) -> int:
    """The step count a run dir's training ends at: `max_steps`, or fewer when its budget was fitted."""
    fitted = (manifest.get("budget") or {}).get("fitted_steps")
    return min(max_steps, int(fitted)) if max_minutes > 0 and fitted else max_steps


# a run already past its deadline still trains the steps its budget times (set-up and pace), then ends
MIN_TRAIN_MINUTES = 1.0


def minutes_for_training(run_minutes: float, reserve_minutes: float, elapsed_s: float, train_minutes: float) -> float:
    """`run.max_minutes`: train.max_minutes for a run `elapsed_s` seconds in: what is left of `run_minutes` less
    `reserve_minutes`, at most `train_minutes` (0: no cap of its own), at least MIN_TRAIN_MINUTES."""
    left = run_minutes - reserve_minutes - elapsed_s / 60
    return max(MIN_TRAIN_MINUTES, min(train_minutes, left) if train_minutes > 0 else left)


class StepBudget:
    """Times steps until `due()`, then `fit(done, max_steps, per_step)` -> the run's step count."""

    def __init__(self, seconds: float, max_steps: int, skip: int = 2, window: int = 0):
        if seconds <= 0:
            raise ValueError(f"a step budget needs seconds > 0, got {seconds}")
        self.seconds, self.skip = float(seconds), skip
        # a tenth of the run (8-100 steps): the pace of a 2-core CPU drifts by 10% over minutes, and the
        # steps timed still train; in the demo of 2026-12-06 the first 18 steps read 1.448 s against the run's
        # 1.540 (its steps ran 6% over), the first 60 of its logged steps 1.532
        self.window = window or max(8, min(100, max_steps // 10))
        self.times: list[float] = []

    def add(self, seconds: float) -> None:
        self.times.append(seconds)

    def due(self) -> bool:
        return len(self.times) == self.skip + self.window

    def per_step(self) -> float:
        """Mean seconds of the timed steps (the first `skip` left out)."""
        timed = self.times[self.skip:] or self.times
        return sum(timed) / max(1, len(timed))

    def fit(self, done: int, max_steps: int, per_step: float) -> int:
        """Steps the run trains in all: `done` so far plus what the rest of the budget buys at `per_step`
        seconds each, at most `max_steps`, at least `done` (a budget already spent ends the run now)."""
        left = self.seconds - sum(self.times)
        more = int(left // per_step) if per_step > 0 else max_steps
        return max(done, min(max_steps, done + max(0, more)))
