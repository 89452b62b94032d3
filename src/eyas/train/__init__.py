"""Stage 3: train the EAGLE-3 head with the TTT loss under FSDP2 (`eyas train`).

    eyas train --target DIR --features FEAT --out RUN [--max-steps N] [--resume]
    torchrun --nproc_per_node N -m eyas train ...

Components (torchtitan-like): `parallel` (process group, FSDP2), `data` (sources, global
micro-batch order), `checkpoint` (DCP, atomic, resharding resume), `metrics` (per-position
accuracy, estimated AL), `loop` (`Trainer`: build, step, save, fit; a checkpoint callback
it is handed: `eyas train` passes serve-eval's, `eyas.serve_eval.checkpoint_callback`).
"""

from __future__ import annotations

import json
import os

from eyas.train.loop import resolve_lengths, resume_point, train

__all__ = ["print_summary", "resolve_lengths", "resume_point", "train"]


def print_summary(summary: dict) -> None:
    """The run's summary as one JSON line on stdout, once (rank 0; the process group is gone by now)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({k: v for k, v in summary.items() if k != "last"} | {"last": _brief(summary.get("last"))}))


def _brief(rec):
    if not rec:
        return rec
    return {k: rec[k] for k in ("step", "loss", "acc", "cond_acc", "est_al", "est_al_chain", "tokens_per_s") if k in rec}
