"""More prompts for a run's learning curve (#13): the run's own sources at a larger cap, less
every prompt the run already has (train or eval), so the run's held-out prompts stay held out.

    python scripts/more_prompts.py --run runs/demo --recipe demo --max-per-source 400 --out EXTRA.jsonl
    eyas synth --recipe demo synth.prompts=EXTRA.jsonl synth.out=EXTRA_SYNTH
    cat runs/demo/synth/conversations.jsonl EXTRA_SYNTH/conversations.jsonl > BIG.jsonl
    eyas extract --recipe demo extract.data=BIG.jsonl extract.out=BIG_FEATS extract.max_len=768

The mix is capped and split by hashed id (eyas.data.split), so a larger cap keeps the smaller
cap's train and eval sides; the prompt-key check below makes sure of it.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from eyas.config import load_recipe
from eyas.data import build_mix
from eyas.data.normalize import prompt_key
from eyas.io import iter_jsonl, write_jsonl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="an eyas run dir (its data/train.jsonl and data/eval.jsonl)")
    ap.add_argument("--recipe", default="demo", help="the run's recipe (its data sources and seed)")
    ap.add_argument("--max-per-source", type=int, required=True, help="the larger data.max_per_source")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    d = load_recipe(a.recipe).data
    run = Path(a.run)
    have = [rec for f in ("train", "eval") for _, rec in iter_jsonl(run / "data" / f"{f}.jsonl")]
    ids, keys = {r["id"] for r in have}, {prompt_key(r["messages"]) for r in have}
    with tempfile.TemporaryDirectory() as tmp:
        # root=tmp: the larger cap is fetched apart, so the cached sources of the run's cap stay as they are
        mix = build_mix(d.sources, a.max_per_source, d.seed, Path(tmp) / "mix", d.eval_fraction, root=tmp)
        new = [r for _, r in iter_jsonl(mix["train"]) if r["id"] not in ids and prompt_key(r["messages"]) not in keys]
    write_jsonl(a.out, new)
    print(f"{len(new)} prompts beside the run's {len(have)} -> {a.out}")


if __name__ == "__main__":
    main()
