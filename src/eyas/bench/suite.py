"""The acceptance suite: SPEED-Bench's design (qualitative categories + input-length buckets)
rebuilt from local, licensed sources, none of whose prompts a draft trained on.

SPEED-Bench (NVIDIA) has 11 categories of 80 prompts and throughput splits by input length;
its data is not reachable here, so each category draws from the wheels eyas already reads:

    coding        HumanEval problems + ShareGPT first turns that ask for code
    math          fresh reasoning-gym GSM-symbolic problems (another seed than training's)
    multilingual  chatterbot-corpus dialogs in languages other than English + non-Latin ShareGPT turns
    rag           pydoc: answer a question from two documents (one a distractor)
    summarization pydoc: summarize a documentation chunk
    qa            ShareGPT first turns that are one short question
    writing       ShareGPT first turns that ask for a story, poem, essay, email, ...
    roleplay      ShareGPT first turns that set a persona ("act as", "pretend", "you are a")
    reasoning     reasoning-gym logic generators (syllogisms, Alice-in-Wonderland, knights & knaves)

ShareGPT turns are sorted into the first category whose rule matches (roleplay, coding,
writing, qa); a turn that matches none is left out. Buckets `ctx-<N>` are pydoc prompts
padded with real text to N prompt tokens as the target's tokenizer and template count them.
Every prompt is the first user turn (plus a system turn when the source has one); a prompt
whose id or any user turn's text is in an `exclude` file (the draft's training split) is dropped.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from random import Random
from typing import Any, Callable

from eyas.data.normalize import Counts, dedup, make_record

CATEGORIES = ("coding", "math", "multilingual", "rag", "summarization", "qa", "writing", "roleplay", "reasoning")
REASONING_GENERATORS = ("logic.syllogisms", "logic.aiw", "logic.knights_knaves")  # reasoning-gym modules
SUITE_SEED_OFFSET = 7919  # generated sources (gsm, logic) use seed + this: other problems than training's

_ROLEPLAY = re.compile(r"\b(act as|acting as|pretend (to be|you are)|role-?play|you are (a|an|my) |imagine you are)\b", re.I)
_CODE = re.compile(r"```|\b(python|javascript|typescript|java|c\+\+|c#|sql|html|css|bash|rust|golang|react|regex|"
                   r"function|code|script|class|api|compile|debug)\b", re.I)
_WRITING = re.compile(r"\b(write|compose|draft|create)\b.{0,40}\b(story|poem|essay|article|blog|email|letter|song|"
                      r"lyrics|speech|script|post|tweet|description|cover letter|paragraph|novel|chapter)\b", re.I | re.S)
_QUESTION = re.compile(r"^(what|who|why|how|when|where|which|is|are|can|could|does|do|did|should|will|would)\b", re.I)


def sharegpt_category(text: str) -> str | None:
    """The suite category of a ShareGPT first user turn, or None (general chat: not in the suite)."""
    head = text[:600]
    if _ROLEPLAY.search(head):
        return "roleplay"
    if _CODE.search(head):
        return "coding"
    if _WRITING.search(head):
        return "writing"
    if len(text) <= 300 and _QUESTION.match(text.strip()) and text.strip().endswith("?") and text.count("?") == 1:
        return "qa"
    return None


def _latin_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c < "\u0250" for c in letters) / len(letters) if letters else 1.0


def first_turn(rec: dict[str, Any]) -> list[dict[str, str]]:
    """The system turn (if any) and the first user turn of a record."""
    out = []
    for m in rec["messages"]:
        if m["role"] == "assistant":
            break
        out.append(m)
        if m["role"] == "user":
            break
    return out


def _norm(text: str) -> str:
    return " ".join(text.split())


class Exclusions:
    """Ids and user-turn texts of the training split(s): a suite prompt matching either is dropped."""

    def __init__(self, paths: list[Path]):
        from eyas.data.store import read_jsonl

        self.paths, self.ids, self.texts = [str(p) for p in paths], set(), set()
        for p in paths:
            if not Path(p).exists():
                raise ValueError(f"bench.exclude: {p} does not exist (pass the draft's training split, "
                                 f"e.g. RUN/data/train.jsonl, or bench.exclude=[] to check nothing)")
            for r in read_jsonl(p):
                self.ids.add(r["id"])
                self.texts.update(_norm(m["content"]) for m in r["messages"] if m["role"] == "user")

    def hit(self, rec: dict[str, Any]) -> bool:
        return rec["id"] in self.ids or any(_norm(m["content"]) in self.texts
                                            for m in rec["messages"] if m["role"] == "user")


def _wheel(name: str) -> Path:
    from eyas.data.sources import download_wheel, get_source
    from eyas.data.store import data_root

    return download_wheel(get_source(name).requirement, data_root() / ".wheels", name)


def _reasoning(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` problems from each logic generator."""
    from eyas.data.sources import run_reasoning_gym

    out = []
    for line in run_reasoning_gym(_wheel("gsm"), n, seed, REASONING_GENERATORS):
        ex = json.loads(line)
        msgs = [{"role": "user", "content": ex["question"].strip()}]
        out.append(make_record("reasoning", "reasoning", msgs, {"generator": ex["generator"]}))
    return out


def category_pools(seed: int, counts: Counts) -> dict[str, list[list[dict[str, Any]]]]:
    """category -> pools of candidate records (one pool per source), in source order."""
    from eyas.data import sources as S

    pools: dict[str, list[list[dict]]] = {c: [] for c in CATEGORIES}
    share: dict[str, list[dict]] = {"roleplay": [], "coding": [], "writing": [], "qa": [], "multilingual": []}
    for rec in S.read_sharegpt(_wheel("sharegpt"), 0, seed, counts):
        msgs = first_turn(rec)
        text = msgs[-1]["content"]
        cat = "multilingual" if _latin_share(text) < 0.5 else sharegpt_category(text)
        if cat:
            share[cat].append({**rec, "domain": cat, "messages": msgs})
    human = list(S.read_humaneval(_wheel("humaneval"), 0, seed, counts))
    pools["coding"] = [[{**r, "domain": "coding"} for r in human], share["coding"]]
    pools["math"] = [S.read_gsm(_wheel("gsm"), 400, seed + SUITE_SEED_OFFSET, counts)]
    chat = [r for r in S.read_multilingual(_wheel("multilingual"), 0, seed, counts)
            if r["meta"]["language"] != "english"]
    pools["multilingual"] = [[{**r, "messages": first_turn(r)} for r in chat], share["multilingual"]]
    from eyas.data.pydoc_prompts import read_pydoc

    doc = read_pydoc(seed, counts)
    pools["rag"] = [[r for r in doc if r["domain"] == "rag"]]
    pools["summarization"] = [[r for r in doc if r["domain"] == "summarization"]]
    for cat in ("qa", "writing", "roleplay"):
        pools[cat] = [share[cat]]
    pools["reasoning"] = [_reasoning(60, seed + SUITE_SEED_OFFSET)]
    return pools


def _queues(pools: list[list[dict]], rng: Random) -> list[list[dict]]:
    """Each pool shuffled: records are taken from the end."""
    return [rng.sample(p, len(p)) for p in pools if p]


def reserve(depth: int, seed: int = 0) -> list[dict[str, Any]]:
    """Every record the suite can take within `depth` of the end of each of its shuffled pools: the suite
    with `per_category` prompts is inside this whenever no pool has `depth - per_category` of its records
    rejected (training prompts, too long for a bucket); a pool smaller than `depth` is reserved whole."""
    pools, rng, out = category_pools(seed, Counts()), Random(f"suite:{seed}"), []
    for cat in CATEGORIES:  # the order build_suite draws its shuffles in
        out += [{**r, "domain": cat} for q in _queues(pools[cat], rng) for r in q[-depth:]]
    return out


def _take(pools: list[list[dict]], n: int, rng: Random, keep: Callable[[dict], bool]) -> list[dict]:
    """Round-robin over shuffled pools until `n` records that `keep` accepts."""
    queues = _queues(pools, rng)
    out: list[dict] = []
    while len(out) < n and any(queues):
        for q in queues:
            while q and len(out) < n:
                r = q.pop()
                if keep(r):
                    out.append(r)
                    break
    return out


def build_suite(per_category: int, exclude: list[Path], seed: int = 0, categories: tuple[str, ...] = CATEGORIES,
                too_long: Callable[[dict], bool] = lambda r: False) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(records, info): `per_category` prompts of each category, none in `exclude`, deduplicated.

    info: {"excluded": {category: n dropped as training prompts}, "short": [categories below per_category]}.
    """
    unknown = set(categories) - set(CATEGORIES)
    if unknown:
        raise ValueError(f"bench.categories: unknown {sorted(unknown)}; choose from {', '.join(CATEGORIES)}")
    counts, ex = Counts(), Exclusions(exclude)
    pools = category_pools(seed, counts)
    seen: set[str] = set()
    dropped: dict[str, int] = {}

    def keep_for(cat: str) -> Callable[[dict], bool]:
        def keep(r: dict) -> bool:
            if ex.hit(r):
                dropped[cat] = dropped.get(cat, 0) + 1
                return False
            if r["id"] in seen or too_long(r):
                return False
            seen.add(r["id"])
            return True
        return keep

    rng = Random(f"suite:{seed}")
    out: list[dict] = []
    for cat in categories:
        out += [{**r, "domain": cat} for r in _take(pools[cat], per_category, rng, keep_for(cat))]
    out = dedup(out, counts)
    have = {c: sum(r["domain"] == c for r in out) for c in categories}
    return out, {"excluded": dropped, "per_category": have, "short": [c for c, n in have.items() if n < per_category],
                 "exclude_files": ex.paths}
