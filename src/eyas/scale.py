"""Prompts for millions of generated tokens (#32): every source eyas ships at full size, as one file
that travels to a GPU machine (no hub there, no wheels to download).

    python scripts/scale_prompts.py --out DIR [--gsm 14000] [--max-user-turns 4]
    -> DIR/prompts.jsonl (shuffled by hashed id: any prefix samples every source), DIR/manifest.json

What goes in: every ShareGPT conversation (its first `max_user_turns` user turns; the assistant turns
in between are placeholders, since `synth.turns: regenerate` writes every reply anew), `gsm`
generated math problems from the same seed as the recipes (so the recipes' own problems are among
them), every multilingual dialog, every pydoc RAG / summarization prompt, the HumanEval problems.

What stays out, by id and by user-turn text: the held-out side of every source (the hashed-id split
at `eval_fraction` and `seed`, so the demo's and the full recipe's eval prompts at any cap) and every
prompt with a user turn one of them has, and a reserve of the SPEED-shaped suite (`eyas bench al`):
every prompt within `reserve_depth` of the end of each of its shuffled pools (`eyas.bench.suite.reserve`),
a superset of what the suite picks even when it drops training prompts or prompts too long for a
context bucket. Reserved first, so a draft trained on this file is measured on the same suite as the
drafts before it.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from eyas.bench.suite import reserve
from eyas.data.normalize import Counts, dedup
from eyas.data.split import split, unit
from eyas.io import write_jsonl
from eyas.manifest import sha256_file, write_manifest

PLACEHOLDER = "(written anew by the target)"  # an input assistant turn: synth.turns=regenerate replaces it


def _norm(text: str) -> str:
    return " ".join(text.split())


def _user_texts(rec: dict[str, Any]) -> set[str]:
    return {_norm(m["content"]) for m in rec["messages"] if m["role"] == "user"}


def suite_reserve(depth: int, seed: int = 0) -> tuple[set[str], set[str]]:
    """(ids, user-turn texts) of every prompt the suite can take within `depth` of each pool (eyas.bench.suite)."""
    recs = reserve(depth, seed)
    return {r["id"] for r in recs}, set().union(*(_user_texts(r) for r in recs))


def first_user_turns(messages: list[dict[str, str]], n: int) -> list[dict[str, str]]:
    """The conversation up to its n-th user turn, assistant turns replaced by a placeholder."""
    out, users = [], 0
    for m in messages:
        if m["role"] == "user":
            if users == n:
                break
            users += 1
        out.append({**m, "content": PLACEHOLDER} if m["role"] == "assistant" else m)
    while out and out[-1]["role"] == "assistant":
        out.pop()
    return out


def source_records(gsm: int, seed: int, counts: Counts) -> dict[str, list[dict[str, Any]]]:
    """Every source at full size (gsm: `gsm` problems)."""
    from eyas.bench.suite import _wheel
    from eyas.data import sources as S
    from eyas.data.pydoc_prompts import read_pydoc

    return {"sharegpt": S.read_sharegpt(_wheel("sharegpt"), 0, seed, counts),
            "gsm": S.read_gsm(_wheel("gsm"), gsm, seed, counts),
            "multilingual": S.read_multilingual(_wheel("multilingual"), 0, seed, counts),
            "pydoc": read_pydoc(seed, counts),
            "humaneval": S.read_humaneval(_wheel("humaneval"), 0, seed, counts)}


def build_scale_prompts(out: str | Path, gsm: int = 14000, max_user_turns: int = 4, seed: int = 0,
                        eval_fraction: float = 0.05, reserve_depth: int = 400, min_prompts: int = 30000,
                        sources: dict[str, list[dict[str, Any]]] | None = None) -> dict[str, Any]:
    """Write `out/prompts.jsonl` (+ manifest); returns the manifest. `sources` replaces the shipped ones
    (tests). Fewer than `min_prompts` prompts is a ValueError."""
    out = Path(out)
    counts = Counts()
    recs = sources if sources is not None else source_records(gsm, seed, counts)
    ids, texts = suite_reserve(reserve_depth, seed) if reserve_depth else (set(), set())
    dropped: Counter = Counter()
    sides = {name: split(rs, eval_fraction, seed) for name, rs in recs.items()}
    held_texts = set().union(set(), *(_user_texts(r) for _, held in sides.values() for r in held))
    kept: list[dict[str, Any]] = []
    for name, (train, held) in sides.items():
        dropped["held_out"] += len(held)
        for r in train:
            if r["id"] in ids or _user_texts(r) & texts:
                dropped["suite_reserve"] += 1
                continue
            if _user_texts(r) & held_texts:  # a user turn some held-out prompt has too ("Hej", "continue")
                dropped["shares_a_held_out_turn"] += 1
                continue
            msgs = first_user_turns(r["messages"], max_user_turns)
            kept.append({**r, "messages": msgs, "meta": {**r.get("meta", {}), "source": name}})
    kept = dedup(kept, counts)
    kept.sort(key=lambda r: unit(r["id"], seed, "scale"))
    if len(kept) < min_prompts:
        raise ValueError(f"only {len(kept)} prompts survive (held out {dropped['held_out']}, suite reserve "
                         f"{dropped['suite_reserve']}); raise gsm (now {gsm}) or lower min_prompts ({min_prompts})")
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "prompts.jsonl", kept)
    per_source = Counter(r["meta"]["source"] for r in kept)
    users = sum(sum(m["role"] == "user" for m in r["messages"]) for r in kept)
    return write_manifest(out, "scale_prompts", None, complete=True, prompts=len(kept), user_turns=users,
                          per_source=dict(sorted(per_source.items())), dropped=dict(dropped),
                          skipped=dict(counts.skipped), settings={"gsm": gsm, "max_user_turns": max_user_turns,
                          "seed": seed, "eval_fraction": eval_fraction, "reserve_depth": reserve_depth},
                          turns="regenerate", sha256=sha256_file(out / "prompts.jsonl"),
                          note="assistant turns are placeholders: synthesize with synth.turns=regenerate")
