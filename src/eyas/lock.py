"""One writer per output dir; shared caches taken in turn. OS file locks (the `filelock` package, as
the Hugging Face caches use it): the kernel releases them when their process ends, kill -9 included,
so a lock left by a killed run never blocks the next one.

    with writing(out, "extract"):   a stage's output dir or a run dir: a second writer is refused at
                                    once (`Busy`, a ValueError: exit 2, naming the dir and the holder)
    with waiting(path):             a shared cache entry (a model, a data source, a draft vocab): a
                                    second process waits for the first, then finds its result
    held_env(env)                   `env` for the processes this one starts to write inside its locks
                                    (torchrun ranks under `eyas run`): they skip taking them again

A lock is the file `.NAME.lock` beside what it guards (`runs/.demo.lock` for `runs/demo`), holding the
pid and command line of the process that holds it. Lock files stay (removing one another process may
be waiting on would let two writers in). A process takes the same lock again freely (nested stages).
Readers (eval, bench on a finished draft, export's source run) take none.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ENV = "EYAS_HELD_LOCKS"  # dirs (resolved, os.pathsep-separated) a parent eyas process holds for this one

_held: dict[Path, list] = {}  # lock file -> [FileLock, depth] held by this process


class Busy(ValueError):
    """Another process is writing the dir (a user error: exit 2)."""


def is_lock_name(name: str) -> bool:
    """`.NAME.lock`: a lock file of eyas's (never foreign content, never output)."""
    return name.startswith(".") and name.endswith(".lock") and len(name) > len("..lock")


def lock_file(path: str | os.PathLike) -> Path:
    p = Path(path).expanduser().resolve()
    return p.parent / f".{p.name}.lock"


def holder(lock: Path) -> str:
    """Who holds `lock`, as its holder wrote it ("pid N: COMMAND"), or a plain phrase."""
    try:
        text = lock.read_text(errors="replace").strip()
    except OSError:
        text = ""
    return text or "another process"


def _inherited(path: Path) -> bool:
    return str(path) in os.environ.get(ENV, "").split(os.pathsep)


@contextlib.contextmanager
def _hold(path: str | os.PathLike, timeout: float) -> Iterator[bool]:
    """Hold the lock of `path` (timeout 0: try once; -1: wait). Yields False if it is held elsewhere."""
    import filelock

    lf = lock_file(path)
    if lf in _held:
        _held[lf][1] += 1
        try:
            yield True
        finally:
            _held[lf][1] -= 1
        return
    lf.parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(str(lf), thread_local=False)
    try:
        lock.acquire(timeout=timeout)
    except filelock.Timeout:
        yield False
        return
    try:
        with open(lf, "r+") as f:  # the lock is ours: say who holds it, for the refusal message
            f.truncate(0)
            f.write(f"pid {os.getpid()}: {' '.join(_argv())}\n")
        _held[lf] = [lock, 1]
        yield True
    finally:
        _held.pop(lf, None)
        lock.release()


def _argv() -> list[str]:
    argv = list(sys.argv)
    if argv and argv[0].endswith(("__main__.py", "/eyas")):
        argv[0] = "eyas"
    return argv


@contextlib.contextmanager
def writing(path: str | os.PathLike, what: str) -> Iterator[None]:
    """Hold `path`'s one-writer lock while `what` (a stage name) writes it; `Busy` when another holds it."""
    p = Path(path).expanduser().resolve()
    if _inherited(p):  # a parent eyas process holds it and started this one to write inside it
        yield
        return
    with _hold(p, timeout=0) as got:
        if not got:
            raise Busy(f"{p} is being written by {holder(lock_file(p))} (its lock: {lock_file(p)}); "
                       f"wait for that {what} to finish, or choose another output dir")
        yield


@contextlib.contextmanager
def waiting(path: str | os.PathLike, what: str = "") -> Iterator[None]:
    """Hold `path`'s lock, waiting for another process that holds it (said once on stderr)."""
    p = Path(path).expanduser().resolve()
    if _inherited(p):
        yield
        return
    with _hold(p, timeout=0) as got:
        if got:
            yield
            return
    print(f"eyas: waiting for {holder(lock_file(p))} to finish {what or p}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with _hold(p, timeout=-1):
        print(f"eyas: {p} free after {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        yield


def held_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with the dirs this process holds added to EYAS_HELD_LOCKS."""
    env = dict(os.environ if env is None else env)
    dirs = [str(lf.parent / lf.name[1 : -len(".lock")]) for lf in _held]
    have = [d for d in env.get(ENV, "").split(os.pathsep) if d]
    env[ENV] = os.pathsep.join(dict.fromkeys(have + dirs))
    return env
