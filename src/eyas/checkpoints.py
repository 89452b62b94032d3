"""A training run's checkpoints by name: where they live, which is `latest`, which is `best`,
and the draft weights inside one. The trainer writes them (`eyas.train.checkpoint`); export,
serve-eval and the report read them here.

    RUN/checkpoints/step_N/      one complete checkpoint (trainer.json written last)
    RUN/checkpoints/latest       a file naming the newest complete one ("step_N")
    RUN/checkpoints/best         a relative symlink to the checkpoint with the highest true AL
    RUN/checkpoints/best.json    that checkpoint's serve-eval record

`best` is the pointer a validator's number moves (`mark_best`); when no serve-eval ran,
`resolve_checkpoint(run, "best")` says so and takes `latest`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from eyas.io import atomic_write_text

CKPT_DIR = "checkpoints"
LATEST = "latest"
BEST = "best"


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CKPT_DIR


def step_name(step: int) -> str:
    return f"step_{step}"


def is_complete(ckpt: Path) -> bool:
    return (ckpt / "trainer.json").exists()


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint `latest` names, or the highest complete step_N, or None."""
    ck = checkpoints_dir(run_dir)
    p = ck / LATEST
    if p.is_file():
        cand = ck / p.read_text().strip()
        if is_complete(cand):
            return cand
    steps = sorted((int(d.name[5:]), d) for d in ck.glob("step_*") if d.name[5:].isdigit() and is_complete(d))
    return steps[-1][1] if steps else None


def mark_latest(run_dir: str | os.PathLike, ckpt: Path) -> None:
    atomic_write_text(checkpoints_dir(run_dir) / LATEST, ckpt.name + "\n")


def resolve_checkpoint(run_dir: str | os.PathLike, which: str) -> Path:
    """RUN/checkpoints/{best,latest,step_N,N}: a dir, a symlink, or a file holding a dir name."""
    ck = checkpoints_dir(run_dir)
    if not ck.is_dir():
        raise ValueError(f"{run_dir}: no {CKPT_DIR}/ directory (is this a training run dir?)")
    if which.isdigit():
        which = step_name(int(which))

    def follow(p: Path) -> Path | None:
        if p.is_dir():
            return p.resolve()
        for cand in (p, p.with_suffix(".json")):
            if cand.is_file():
                text = cand.read_text().strip()
                if cand.suffix == ".json":
                    text = str(json.loads(text).get("checkpoint", ""))
                q = Path(text) if Path(text).is_absolute() else ck / text
                if text and q.is_dir():
                    return q.resolve()
        return None

    got = follow(ck / which)
    if got is None and which == BEST:
        got = follow(ck / LATEST)
        if got is not None:
            print(f"eyas: {ck}: no {BEST} (no serve-eval ran); using {LATEST} = {got.name}", file=sys.stderr)
    if got is None:
        have = sorted(p.name for p in ck.iterdir())
        raise ValueError(f"{ck}: no checkpoint {which!r}; available: {', '.join(have) or 'none'}")
    return got


def best_record(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    p = checkpoints_dir(run_dir) / f"{BEST}.json"
    return json.loads(p.read_text()) if p.exists() else None


def mark_best(run_dir: str | os.PathLike, ckpt_dir: Path, record: dict[str, Any]) -> None:
    """Point `checkpoints/best` at `ckpt_dir` (relative symlink, replaced atomically) and write best.json."""
    ck = checkpoints_dir(run_dir)
    ck.mkdir(parents=True, exist_ok=True)
    link = ck / BEST
    if link.exists() and not link.is_symlink():
        raise RuntimeError(f"{link} exists and is not a symlink; refusing to replace it")
    rel = os.path.relpath(Path(ckpt_dir).resolve(), ck.resolve())
    tmp = ck / f".{BEST}.tmp.{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(rel, tmp)
    os.replace(tmp, link)
    atomic_write_text(ck / f"{BEST}.json", json.dumps({**record, "checkpoint": rel}, indent=2) + "\n")


def load_draft_state(ckpt_dir: str | os.PathLike):
    """(state_dict full on CPU with vLLM's names incl. d2t / t2d / embed_tokens, meta from draft.json).

    Reads only the model part of the DCP checkpoint, without collectives (safe to call on
    one rank while the others wait)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from eyas.draft.model import Eagle3Draft
    from eyas.draft.spec import DraftSpec

    ckpt_dir = Path(ckpt_dir)
    meta_path = ckpt_dir / "draft.json"
    if not meta_path.exists():
        raise ValueError(f"{ckpt_dir}: no draft.json (not an eyas training checkpoint, or an unfinished one)")
    meta = json.loads(meta_path.read_text())
    spec = DraftSpec.from_draft_config(meta["draft_config"])
    with torch.device("meta"):
        shell = Eagle3Draft(spec)
    state = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in shell.state_dict().items()}
    with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": state}, checkpoint_id=str(ckpt_dir / "dcp"), no_dist=True)
    return state, meta
