"""Stage 0: prompt data from offline sources, normalized to `{"id", "domain", "messages"}` JSONL.

    eyas data fetch [NAME...]          # -> <root>/<name>/{train,eval}.jsonl + manifest.json
    eyas data stats FILE|DIR|NAME...   # counts, domains, turns, char-length histogram
    eyas data mix [NAME...] --out DIR  # train/eval splits of several sources in one dir

`root` is `data.out` or `$EYAS_HOME/data`. For `mix`, `--out` (data.out) is where the
mix is written (default `$EYAS_HOME/data/mix`) and the sources live under the default root.
"""

from __future__ import annotations

from eyas.config import DataConfig, RunConfig
from eyas.data.normalize import make_record, prompt_key
from eyas.data.pydoc_prompts import long_context_prompts
from eyas.data.sources import SOURCES, get_source
from eyas.data.stats import report
from eyas.data.store import build_mix, data_root, fetch_source, read_jsonl, write_jsonl
from eyas.manifest import read_manifest

__all__ = ["SOURCES", "build_mix", "cli", "data_root", "fetch_source", "long_context_prompts", "make_record",
           "prompt_key", "read_jsonl", "write_jsonl"]

USAGE = "usage: eyas data fetch [NAME...] | eyas data stats FILE|DIR|NAME... | eyas data mix [NAME...] --out DIR"


def cli(d: DataConfig, actions: list[str], run: RunConfig) -> int:
    if not actions or actions[0] not in ("fetch", "stats", "mix", "list"):
        raise ValueError(f"{USAGE}; sources: {', '.join(SOURCES)}")
    action, names = actions[0], actions[1:]
    if action == "list":
        for name, src in SOURCES.items():
            print(f"{name}\t{src.requirement or 'stdlib'}\t{src.what}")
        return 0
    if action == "stats":
        if not names:
            raise ValueError("usage: eyas data stats FILE|DIR|NAME...")
        print("\n\n".join(report(n, data_root(d.out)) for n in names))
        return 0
    names = names or list(d.sources)
    for name in names:
        get_source(name)
    if action == "mix":
        paths = build_mix(names, d.max_per_source, d.seed, d.out or data_root() / "mix", d.eval_fraction)
        man = read_manifest(paths["train"].parent) or {}
        print(f"mix\ttrain {man.get('train')}\teval {man.get('eval')}\t{paths['train'].parent}")
        return 0
    for name in names:
        path = fetch_source(name, d.max_per_source, d.eval_fraction, d.seed, d.out)
        man = read_manifest(path) or {}
        skipped = ", ".join(f"{k} {v}" for k, v in sorted((man.get("skipped") or {}).items())) or "none"
        print(f"{name}\ttrain {man.get('train')}\teval {man.get('eval')}\t(read {man.get('read')}, "
              f"unique {man.get('unique')}; skipped: {skipped})\t{path}")
    return 0
