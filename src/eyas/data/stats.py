"""`eyas data stats`: counts, domains, turns, languages and a character-length histogram."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from eyas.data.normalize import Counts
from eyas.data.sources import SOURCES
from eyas.data.store import read_jsonl

EDGES = [0, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]


def stats(records: list[dict]) -> dict[str, Any]:
    chars = [sum(len(m["content"]) for m in r["messages"]) for r in records]
    hist = Counter(max(e for e in EDGES if c >= e) for c in chars)
    return {
        "records": len(records),
        "domains": Counter(r["domain"] for r in records),
        "messages": Counter(len(r["messages"]) for r in records),
        "user_turns": Counter(sum(m["role"] == "user" for m in r["messages"]) for r in records),
        "languages": Counter(r["meta"]["language"] for r in records if "language" in r.get("meta", {})),
        "chars_total": sum(chars),
        "chars_max": max(chars, default=0),
        "char_hist": [(e, hist.get(e, 0)) for e in EDGES],
    }


def _top(c: Counter, k: int = 12) -> str:
    items = sorted(c.items(), key=lambda kv: (-kv[1], str(kv[0])))
    more = f", ... ({len(items) - k} more)" if len(items) > k else ""
    return ", ".join(f"{key}: {n}" for key, n in items[:k]) + more


def format_stats(s: dict[str, Any], title: str, skipped: Counter | None = None) -> str:
    n = s["records"]
    lines = [f"== {title}", f"records: {n}"]
    if n:
        lines += [
            f"domains: {_top(s['domains'])}",
            f"messages per record: {_top(s['messages'], 8)}",
            f"user turns per record: {_top(s['user_turns'], 8)}",
            f"chars: mean {s['chars_total'] / n:.0f}, max {s['chars_max']}",
        ]
    if s["languages"]:
        lines.append(f"languages ({len(s['languages'])}): {_top(s['languages'], 30)}")
    if skipped:
        lines.append(f"skipped lines: {_top(skipped)}")
    if n:
        lines.append("chars per record:")
        peak = max(c for _, c in s["char_hist"]) or 1
        edges = EDGES + [None]
        for (lo, c), hi in zip(s["char_hist"], edges[1:]):
            label = f"{lo:>6}-{hi - 1:<6}" if hi else f"{lo:>6}+{'':6}"
            lines.append(f"  {label} {c:>7}  {'#' * round(40 * c / peak)}")
    return "\n".join(lines)


def stats_paths(arg: str, root: Path) -> list[Path]:
    """A JSONL file, a dir holding train/eval JSONL, or a source name fetched under `root`."""
    p = Path(arg).expanduser()
    if p.is_file():
        return [p]
    d = p if p.is_dir() else root / arg
    files = [d / f for f in ("train.jsonl", "eval.jsonl") if (d / f).exists()]
    if not files:
        hint = f"run `eyas data fetch {arg}` first" if arg in SOURCES else f"known sources: {', '.join(SOURCES)}"
        raise ValueError(f"data stats: {arg!r} is not a JSONL file, a data dir, or a fetched source ({hint})")
    return files


def report(arg: str, root: Path) -> str:
    out = []
    for path in stats_paths(arg, root):
        counts = Counts()
        recs = read_jsonl(path, counts)
        out.append(format_stats(stats(recs), str(path), counts.skipped))
    return "\n\n".join(out)
