"""Prompts for millions of generated tokens (#32), as one file that travels: see eyas.scale.

    python scripts/scale_prompts.py --out runs/scale_prompts [--gsm 14000] [--max-user-turns 4]
"""

from __future__ import annotations

import argparse
import json

from eyas.scale import build_scale_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="a dir: prompts.jsonl and manifest.json are written there")
    ap.add_argument("--gsm", type=int, default=14000, help="generated math problems (seed 0, as the recipes)")
    ap.add_argument("--max-user-turns", type=int, default=4, help="user turns kept per ShareGPT conversation")
    ap.add_argument("--reserve-depth", type=int, default=400, help="suite prompts reserved per pool (eyas.bench.suite.reserve)")
    ap.add_argument("--min-prompts", type=int, default=30000)
    a = ap.parse_args()
    man = build_scale_prompts(a.out, a.gsm, a.max_user_turns, reserve_depth=a.reserve_depth, min_prompts=a.min_prompts)
    print(json.dumps({k: man[k] for k in ("prompts", "user_turns", "per_source", "dropped")}, indent=2))


if __name__ == "__main__":
    main()
