"""Failpoints: the places where the fault-injection suite (tests/test_faults.py) kills eyas.

    EYAS_FAILPOINTS="NAME:N[,NAME:N...]"   SIGKILL this process the N-th time it reaches NAME
    EYAS_FAILPOINT_LOG=FILE                append every NAME reached to FILE, one per line

With neither set (every user's run) `reached` costs two environment lookups and returns False.
The names, each placed where a kill leaves the most half-done state:

    write.before_rename   an atomic write (eyas.io.atomic_path) fsynced, not yet renamed over its target
    append.torn           an append (eyas.io.append_jsonl) with only the first half of its bytes written
    extract.shard         a feature shard renamed into place, the manifest not yet listing it
    train.step            an optimizer step done, not yet logged or checkpointed
    checkpoint.dcp        a checkpoint's DCP shards written, nothing else of it
    checkpoint.renamed    a checkpoint renamed into place, `latest` still naming the previous one
"""

from __future__ import annotations

import os
import signal

_counts: dict[str, int] = {}


def _armed() -> dict[str, int]:
    spec = os.environ.get("EYAS_FAILPOINTS", "")
    try:
        return {name: int(n) for name, n in (item.rsplit(":", 1) for item in spec.split(",") if item)}
    except ValueError:
        raise ValueError(f"EYAS_FAILPOINTS={spec!r}: expected NAME:N[,NAME:N...]") from None


def reached(name: str) -> bool:
    """Count one pass through `name`; True when this pass is the one to kill at (the caller may
    leave its half-done state first, then call `die`)."""
    log = os.environ.get("EYAS_FAILPOINT_LOG")
    if not log and "EYAS_FAILPOINTS" not in os.environ:
        return False
    n = _counts[name] = _counts.get(name, 0) + 1
    if log:
        with open(log, "a") as f:
            f.write(name + "\n")
    return _armed().get(name) == n


def die() -> None:
    """SIGKILL this process: no handler, no cleanup, no flush, as a kill -9 or an OOM kill."""
    os.kill(os.getpid(), signal.SIGKILL)


def failpoint(name: str) -> None:
    if reached(name):
        die()
