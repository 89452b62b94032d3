"""Stage 3: train the EAGLE-3 head with the TTT loss under FSDP2 (`eyas train`).

    eyas train --target DIR --features FEAT --out RUN [--max-steps N] [--resume]
    torchrun --nproc_per_node N -m eyas train ...

Components (torchtitan-like): `parallel` (process group, FSDP2), `data` (sources, global
micro-batch order), `checkpoint` (DCP, atomic, resharding resume, `load_draft_state`),
`metrics` (per-position accuracy, estimated AL), `loop` (the loop), `bench` (tokens/s).
"""

from __future__ import annotations

import json
import os


def train(cfg):
    """Train with a TrainConfig; returns the summary dict (see `eyas.train.loop.train`)."""
    from eyas.train.loop import train as _train

    return _train(cfg)


def cli(cfg, actions: list[str]) -> int:
    """`eyas train [--flags]`: cfg is the Recipe, cfg.train the TrainConfig."""
    if actions:
        raise ValueError(f"eyas train takes no actions, got {actions} (use --flags or train.key=value)")
    summary = train(cfg.train)
    if int(os.environ.get("RANK", "0")) == 0:  # the process group is gone by now; print once
        print(json.dumps({k: v for k, v in summary.items() if k != "last"} | {"last": _brief(summary.get("last"))}))
    return 0


def _brief(rec):
    if not rec:
        return rec
    return {k: rec[k] for k in ("step", "loss", "acc", "cond_acc", "est_al", "est_al_chain", "tokens_per_s") if k in rec}
