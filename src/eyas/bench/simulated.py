"""`eyas bench simulated`: the simulated AL (`eyas.draft.simulate`) against vLLM's true AL on
the same conversations, per position.

The conversations are the ones a feature dir was extracted from (`train.features`, its
manifest names them): the samples the trainer held out (`train.holdout`), else the first
`bench.limit`; each assistant turn is replayed in vLLM as the request synthesis
made (the turns before it as the prompt, greedy, the synthesis' max_tokens), with the
exported draft at k = `eval.k`. The simulation runs the same draft (its bf16 weights, as
vLLM loads them) over the stored features. On greedy on-policy data both count the same
chains, so they should agree up to rounding; the replies vLLM writes are checked against
the data, since a reply that differs makes a different chain.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from eyas.acceptance import measure_acceptance, summarize
from eyas.draft.exported import load_exported
from eyas.draft.simulate import simulate_samples
from eyas.features import open_features
from eyas.io import iter_jsonl
from eyas.stage import input_manifest


def held_out_samples(features: Path, limit: int, holdout: int) -> tuple[Any, list[int], Path, int]:
    """(the feature dataset, the indices of the `holdout` samples the trainer held out, else of the first
    `limit`, the conversations file they were made from, the synthesis' max_tokens)."""
    from eyas.train.data import OfflineSource

    ds = open_features(features)
    conv_path = Path(ds.manifest["data"])
    made_by = input_manifest(conv_path) or {}
    max_tokens = int((made_by.get("config") or {}).get("max_tokens") or 128)
    picked = OfflineSource(features, ds.manifest.get("max_len") or 2048, holdout).heldout if holdout else \
        list(range(min(limit, len(ds)) if limit else len(ds)))
    return ds, picked, conv_path, max_tokens


def bench_simulated(target: Path, draft: Path, features: Path, k: int, limit: int = 16,
                    holdout: int = 0) -> dict[str, Any]:
    """Simulated and vLLM AL on the `holdout` samples the trainer held out, else the first `limit`."""
    ds, picked, conv_path, max_tokens = held_out_samples(features, limit, holdout)
    ids = [ds.ids[i] for i in picked]
    model = load_exported(draft, target)
    t0 = time.perf_counter()
    counts = simulate_samples(model, [ds[i] for i in picked], k)
    sim_s = time.perf_counter() - t0
    convs = {str(r["id"]): r for _, r in iter_jsonl(conv_path, "the conversations the features were made from")}
    prompts, replies = [], []
    for cid in ids:
        msgs = convs[cid]["messages"]
        for j, m in enumerate(msgs):
            if m["role"] == "assistant":
                prompts.append({"id": f"{cid}-{j}", "domain": "all", "messages": msgs[:j]})
                replies.append(m["content"])
    rep = measure_acceptance(target, draft, prompts, k=k, max_tokens=max_tokens, by_domain=False,
                             max_model_len=int(ds.manifest.get("max_len") or 2048) + max_tokens, return_texts=True)
    same = sum(a.strip() == b.strip() for a, b in zip(rep["domains"]["all"]["texts"], replies))
    sim = summarize(counts, k)
    out = {
        "features": str(features), "draft": str(draft), "k": k, "conversations": len(ids), "turns": len(prompts),
        "held_out": bool(holdout),
        "replies_identical": same, "max_tokens": max_tokens, "simulate_seconds": sim_s,
        "simulated": {x: sim[x] for x in ("acceptance_length", "per_pos", "num_drafts")},
        "vllm": {x: rep[x] for x in ("acceptance_length", "per_pos", "num_drafts", "skipped_too_long")},
    }
    out["relative_gap"] = sim["acceptance_length"] / rep["acceptance_length"] - 1
    out["per_pos_gap"] = [a - b for a, b in zip(sim["per_pos"], rep["per_pos"])]
    print(f"bench simulated: {len(ids)} conversations ({len(prompts)} turns, {same} replies identical to the data), "
          f"k={k}, {max_tokens} max tokens", file=sys.stderr)
    print(f"  simulated AL {sim['acceptance_length']:.3f} per pos {[round(x, 3) for x in sim['per_pos']]} "
          f"({sim_s:.1f} s)\n  vLLM      AL {rep['acceptance_length']:.3f} per pos "
          f"{[round(x, 3) for x in rep['per_pos']]}\n  gap {out['relative_gap']:+.1%}, per pos "
          f"{[round(x, 3) for x in out['per_pos_gap']]}")
    print(json.dumps(out))
    return out
