"""`eyas bench rules`: which proposer to take per step, decided by simulation (#31, step 1).

On a draft's held-out features (`train.holdout`, else the first `bench.limit` samples) every rule of
`bench.rules` (eyas.draft.hybrid) is replayed: tokens per target decode step per rule, overall and per
domain (the conversations' `domain`). The two pure rules are then served in vLLM on the same turns
(the draft, and n-gram lookup with the same lengths), and lookup>draft as the hybrid eyas serves
(eyas.hybrid_serve), so the simulated figures stand beside the served ones: the rules are only as
good as that agreement.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from eyas.acceptance import measure_acceptance
from eyas.draft.exported import load_exported
from eyas.bench.simulated import held_out_samples
from eyas.draft.hybrid import simulate_rules, tokens_per_step
from eyas.io import iter_jsonl


def _turns(convs: dict[str, dict], ids: list[str]) -> list[dict[str, Any]]:
    """Every assistant turn of the conversations `ids` as the request synthesis made (the turns before it)."""
    out = []
    for cid in ids:
        msgs = convs[cid]["messages"]
        out += [{"id": f"{cid}-{j}", "domain": convs[cid].get("domain", "all"), "messages": msgs[:j]}
                for j, m in enumerate(msgs) if m["role"] == "assistant"]
    return out


def bench_rules(target: Path, draft: Path, features: Path, k: int, rules: list[str], ngram: tuple[int, int] = (2, 4),
                limit: int = 16, holdout: int = 0, serve: bool = True) -> dict[str, Any]:
    ds, picked, conv_path, max_tokens = held_out_samples(features, limit, holdout)
    ids = [ds.ids[i] for i in picked]
    convs = {str(r["id"]): r for _, r in iter_jsonl(conv_path, "the conversations the features were made from")}
    domains = [convs[i].get("domain", "all") for i in ids]
    model = load_exported(draft, target)
    rules = list(dict.fromkeys(["draft", "lookup", *rules]))
    sim = simulate_rules(model, [ds[i] for i in picked], k, rules, ngram, domains)
    table = {r: {d: tokens_per_step(c) for d, c in per.items()} for r, per in sim.items()}
    out: dict[str, Any] = {"features": str(features), "draft": str(draft), "k": k, "ngram": list(ngram),
                           "conversations": len(ids), "held_out": bool(holdout), "simulated": sim,
                           "tokens_per_step": table}
    if serve:
        turns = _turns(convs, ids)
        mml = int(ds.manifest.get("max_len") or 2048) + max_tokens
        from eyas.hybrid_serve import parse_lookup, with_policy

        # the pure draft (any exported policy stripped), n-gram alone, and the lookup>draft rule served as a hybrid
        hybrid = "lookup>draft"
        serves = {"draft": with_policy(draft, None), "lookup": f"ngram:{ngram[0]}:{ngram[1]}",
                  **({hybrid: with_policy(draft, parse_lookup(f"ngram:{ngram[0]}:{ngram[1]}:{hybrid}", k))}
                     if hybrid in rules else {})}
        served = {name: measure_acceptance(target, d, turns, k=k, max_tokens=max_tokens, max_model_len=mml)
                  for name, d in serves.items()}
        out["served"] = {n: {"tokens_per_decode_step": r["tokens_per_decode_step"],
                             "domains": {d: v["tokens_per_decode_step"] for d, v in r["domains"].items()}}
                         for n, r in served.items()}
        out["sim_vs_served"] = {n: table[n]["all"] / out["served"][n]["tokens_per_decode_step"] - 1 for n in served}
    doms = sorted({d for per in table.values() for d in per if d != "all"})
    lines = ["| rule | all | " + " | ".join(doms) + " |", "|---|---|" + "---|" * len(doms)]
    lines += [f"| {r} | {table[r]['all']:.3f} | " + " | ".join(f"{table[r].get(d, float('nan')):.3f}" for d in doms)
              + " |" for r in rules]
    if serve:
        lines += [f"| {n} (served) | {v['tokens_per_decode_step']:.3f} | "
                  + " | ".join(f"{(v['domains'].get(d) or float('nan')):.3f}" for d in doms) + " |"
                  for n, v in out["served"].items()]
    out["table"] = "\n".join(lines)
    print(f"bench rules: {len(ids)} conversations, k={k}, n-gram {ngram[0]}..{ngram[1]}; tokens per target decode "
          "step, simulated" + (" (and the pure rules and lookup>draft served in vLLM)" if serve else ""), file=sys.stderr)
    print(out["table"])
    print(json.dumps({k_: v for k_, v in out.items() if k_ not in ("table", "simulated")}))
    return out
