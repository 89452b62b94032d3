"""Failpoints: the places where the fault-injection suite (tests/test_faults.py) kills eyas, or fails
one of its writes as a full disk or a read-only dir would.

    EYAS_FAILPOINTS="NAME:N[:MODE][,...]"  at the N-th time this process reaches NAME:
                                           kill    SIGKILL it (the default)
                                           enospc  raise OSError(ENOSPC) for the file being written
                                           eacces  raise OSError(EACCES) for it
                                           gate    wait there until the file EYAS_FAILPOINT_GATE exists
                                                   (a process held at a known point: the lock tests)
    EYAS_FAILPOINT_LOG=FILE                append every NAME reached to FILE, one per line

With neither set (every user's run) `hit` costs two environment lookups and returns None.
The names, each placed where a fault leaves the most half-done state:

    write.before_rename   an atomic write (eyas.io.atomic_path) fsynced, not yet renamed over its target
    append.torn           an append (eyas.io.append_jsonl) with only the first half of its bytes written
    extract.shard         a feature shard renamed into place, the manifest not yet listing it
    train.step            an optimizer step done, not yet logged or checkpointed (kill only: no write)
    checkpoint.dcp        a checkpoint's DCP shards written, nothing else of it
    checkpoint.renamed    a checkpoint renamed into place, `latest` still naming the previous one
"""

from __future__ import annotations

import errno
import os
import signal
import time

MODES = {"kill": None, "enospc": errno.ENOSPC, "eacces": errno.EACCES, "gate": None}

_counts: dict[str, int] = {}


def _armed() -> dict[str, str]:
    spec = os.environ.get("EYAS_FAILPOINTS", "")
    out = {}
    for item in filter(None, spec.split(",")):
        parts = item.split(":")
        if len(parts) not in (2, 3) or not parts[1].isdigit() or (len(parts) == 3 and parts[2] not in MODES):
            raise ValueError(f"EYAS_FAILPOINTS={spec!r}: expected NAME:N[:{'|'.join(MODES)}][,...]")
        out[f"{parts[0]}:{parts[1]}"] = parts[2] if len(parts) == 3 else "kill"
    return out


def hit(name: str) -> str | None:
    """Count one pass through `name`; the mode to fail in when this pass is the armed one, else None
    (the caller may leave its half-done state first, then call `fail`)."""
    log = os.environ.get("EYAS_FAILPOINT_LOG")
    if not log and "EYAS_FAILPOINTS" not in os.environ:
        return None
    n = _counts[name] = _counts.get(name, 0) + 1
    if log:
        with open(log, "a") as f:
            f.write(name + "\n")
    mode = _armed().get(f"{name}:{n}")
    if mode == "gate":
        gate = os.environ.get("EYAS_FAILPOINT_GATE", "")
        if not gate:
            raise ValueError("EYAS_FAILPOINTS has a gate: set EYAS_FAILPOINT_GATE=FILE (it opens when FILE exists)")
        while not os.path.exists(gate):
            time.sleep(0.05)
        return None
    return mode


def fail(mode: str, path: str | os.PathLike | None = None) -> None:
    """kill: SIGKILL this process (no handler, no cleanup, no flush: a kill -9 or an OOM kill);
    enospc / eacces: raise the OSError the OS gives for `path`."""
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    code = MODES[mode]
    raise OSError(code, os.strerror(code), None if path is None else str(path))


def failpoint(name: str, path: str | os.PathLike | None = None) -> None:
    if (mode := hit(name)) is not None:
        fail(mode, path)
