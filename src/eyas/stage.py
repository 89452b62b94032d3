"""Where a stage writes and when it has nothing left to do: one rule, used by every stage.

    out = output_dir(cfg.out, "--out")                  the stage's dir, or an error naming the flag
    o = claim(out, "synth", key)                        what is there, checked against this run
    o.complete -> skip;  o.manifest -> resume;  neither -> a new output

A stage writes only into a dir that is missing or empty, or that holds its own manifest
(`eyas.manifest`) for the same key (the resolved settings and input hashes that decide
its content). Anything else is refused with a message naming what is there:

- a non-empty dir without an eyas manifest (foreign content: never deleted);
- another stage's output;
- this stage's output for another key: refused when the output is built in place and
  resumed (synth, extract: `on_change="refuse"`), replaced when the stage writes its
  whole output anew and swaps it in (export, quantize, the model and data caches:
  `on_change="replace"`).

Training resumes by checkpoint instead (`eyas.checkpoints`: a run dir holds its steps) and
refuses a run dir trained with other settings or data the same way. Eval and bench are
measurements: run alone they measure every time and write their reports atomically; `eyas run`
reads its own back when nothing they depend on changed (`eyas.pipeline`).

A refusal for other settings is a `ChangedOutput` naming the dir: `eyas run`, which owns its
stages' dirs, sets such a dir aside (`set_aside`: moved, never deleted) and runs the stage
again, so a changed recipe re-runs the stage it changes and, through their input hashes,
every stage downstream of it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.lock import is_lock_name
from eyas.manifest import read_manifest


class ChangedOutput(ValueError):
    """`dir` holds this stage's output for other settings or inputs (a user error outside `eyas run`)."""

    def __init__(self, message: str, dir: Path):
        super().__init__(message)
        self.dir = Path(dir)


@dataclass(frozen=True)
class Output:
    dir: Path
    manifest: dict[str, Any] | None  # this stage's manifest for this key (None: a new output)

    @property
    def complete(self) -> bool:
        return bool(self.manifest and self.manifest.get("complete"))


def output_dir(value: str | Path, flag: str) -> Path:
    """The dir a stage was told to write (`--out`-like `flag`), expanded; an error when unset."""
    if not str(value):
        raise ValueError(f"no output dir: pass {flag} DIR")
    return Path(value).expanduser()


def is_temp(name: str) -> bool:
    """eyas's own temp names: `.NAME.tmp.PID` files and `.tmp_*` / `.NAME.*` staging dirs."""
    return name.startswith(".") and (".tmp" in name or name.startswith(".tmp_"))


def claim(out: Path, stage: str, key: Any, on_change: str = "refuse",
          key_of: Callable[[dict[str, Any]], Any] = lambda man: man.get("key")) -> Output:
    """Check `out` for `stage` with `key` (see the module doc); returns what may be resumed or skipped."""
    out = Path(out)
    man = read_manifest(out) if out.is_dir() else None
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; {stage} writes a directory: choose another --out")
    if man is None:
        there = sorted(p.name for p in out.iterdir()
                       if not is_temp(p.name) and not is_lock_name(p.name) and p.name != "manifest.json") \
            if out.is_dir() else []
        if there:
            shown = ", ".join(there[:5]) + (f" and {len(there) - 5} more" if len(there) > 5 else "")
            raise ValueError(f"{out} is not empty and is not an eyas {stage} output (it holds {shown}); "
                             "choose another --out or delete it")
        return Output(out, None)
    if man.get("stage") != stage:
        raise ValueError(f"{out} holds an eyas {man.get('stage')!r} output, not an eyas {stage} output; "
                         "choose another --out")
    had = key_of(man)
    if had != key:
        if on_change == "replace":
            return Output(out, None)
        if isinstance(key, dict) and isinstance(had, dict):
            diff = sorted(k for k in set(key) | set(had) if had.get(k) != key.get(k))
        else:
            diff = ["key"]
        raise ChangedOutput(f"{out} holds {stage} output made with different settings (differs in: {', '.join(diff)}); "
                            "choose another --out or delete it", out)
    return Output(out, man)


def set_aside(path: Path, root: Path) -> Path:
    """Move `path` (a stage's output inside the run dir `root`) to `root/superseded/<UTC time>/<name>`;
    nothing is deleted. Returns where it went."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = Path(root) / "superseded" / stamp / Path(path).relative_to(root)
    n = 1
    while dest.exists():  # two set-asides in the same second
        dest = dest.with_name(f"{Path(path).name}.{n}")
        n += 1
    dest.parent.mkdir(parents=True, exist_ok=True)
    Path(path).rename(dest)
    return dest


def input_manifest(path: str | Path) -> dict[str, Any] | None:
    """The manifest of the artifact `path` belongs to: a dir's own, or a file's dir's
    (conversations.jsonl -> the synth dir's manifest); None for input eyas did not make."""
    p = Path(path)
    return read_manifest(p if p.is_dir() else p.parent) if str(path) else None


def inherited(value: int, path: str | Path, stage: str, field: str, default: int) -> int:
    """A setting a stage takes from its input artifact unless it is given one (`value` > 0):
    `field` of the input's manifest when `stage` made it, else `default`."""
    if value > 0:
        return value
    man = input_manifest(path) or {}
    got = man.get(field, (man.get("config") or {}).get(field)) if man.get("stage") == stage else None
    return int(got) if got else default


def say_complete(stage: str, out: Path, detail: str = "") -> None:
    print(f"eyas {stage}: {out} is complete for these inputs{f' ({detail})' if detail else ''}; nothing to do",
          file=sys.stderr)
