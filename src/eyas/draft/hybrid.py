"""The draft or prompt lookup, per step: rules replayed on teacher-forced data (#31, step 1).

At every verification step of a greedy request the server can propose the draft's k tokens or
what prompt lookup finds: vLLM's own n-gram matcher (`vllm.v1.spec_decode.ngram_proposer`, imported
lazily: training never needs vLLM) over the request's history, the longest suffix n-gram of
length MIN..MAX seen earlier, and the tokens after it. On greedy on-policy data the target's
continuation is the data, so each rule's steps can be counted without the target, as
`eyas.draft.simulate` counts the draft's:

    p = s - 1 for each generated span [s, e]; while p + 1 < e:
        draft    = guesses[:, p]  (k ids; conf = the product of its top-1 probabilities)
        lookup   = ngram(ids[:p + 2])  (0..k ids; L = the length of the n-gram it matched)
        proposal = rule(draft, conf, lookup, L); a = leading ids of it equal to ids[p+2:], within e
        steps += 1; tokens += a + 1; p += a + 1

Rules: `draft`, `lookup` (nothing when no match: plain decoding that step, as vLLM's n-gram does),
`lookup>draft` (lookup when it matches, else the draft), `lookupL>=m` (lookup when its n-gram is at
least m long), `conf<c` (lookup when it matches and the draft's confidence is below c), `agree`
(lookup's tokens, continued by the draft's where lookup is shorter than k and agreed with the draft
so far: the draft's later guesses were made after its own earlier ones, so only then are they the
draft's). Tokens per target step = tokens / steps, the figure a server's throughput follows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from eyas.draft.simulate import spans

if TYPE_CHECKING:
    from eyas.draft.model import Eagle3Draft

# (draft ids, draft confidence, lookup ids, n-gram length) -> (proposal, "draft" | "lookup")
Rule = Callable[[list[int], float, list[int], int], tuple[list[int], str]]


def rule(name: str, k: int) -> Rule:
    """The rule called `name` (see the module doc)."""
    if name == "draft":
        return lambda d, c, lk, n: (d, "draft")
    if name == "lookup":
        return lambda d, c, lk, n: (lk, "lookup")
    if name == "lookup>draft":
        return lambda d, c, lk, n: (lk, "lookup") if lk else (d, "draft")
    if name.startswith("lookupL>="):
        m = int(name[len("lookupL>="):])
        return lambda d, c, lk, n: (lk, "lookup") if lk and n >= m else (d, "draft")
    if name.startswith("conf<"):
        cut = float(name[len("conf<"):])
        return lambda d, c, lk, n: (lk, "lookup") if lk and c < cut else (d, "draft")
    if name == "agree":
        def agree(d: list[int], c: float, lk: list[int], n: int) -> tuple[list[int], str]:
            if not lk:
                return d, "draft"
            return (lk + d[len(lk):k] if lk == d[: len(lk)] else lk), "lookup"
        return agree
    raise ValueError(f"unknown rule {name!r}: draft | lookup | lookup>draft | lookupL>=M | conf<C | agree")


def lookup(history: np.ndarray, lo: int, hi: int, k: int, max_model_len: int) -> tuple[list[int], int]:
    """vLLM's n-gram proposal for `history` [T] int32 and the length of the n-gram it matched (0: none)."""
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as find

    out = find(history, lo, hi, max_model_len, k)
    if len(out) == 0:
        return [], 0
    n = next(m for m in range(hi, lo - 1, -1) if len(find(history, m, hi, max_model_len, k)))
    return out.tolist(), n


def walk_rules(draft: list[list[int]], conf: list[float], ids: list[int], generated: list[bool], rules: dict[str, Rule],
               k: int, ngram: tuple[int, int] = (2, 4), max_model_len: int = 1 << 30) -> dict[str, dict[str, int]]:
    """One sequence: draft [T][k] (the draft's ids at each index p), conf [T], ids [T], generated [T] ->
    per rule {steps, tokens, drafts, accepted, lookup_steps, lookup_accepted}."""
    arr = np.asarray(ids, dtype=np.int32)
    out = {name: {"steps": 0, "tokens": 0, "drafts": 0, "accepted": 0, "lookup_steps": 0, "lookup_accepted": 0}
           for name in rules}
    cache: dict[int, tuple[list[int], int]] = {}
    for s, e in spans(torch.tensor(generated)):
        for name, fn in rules.items():
            c, p = out[name], s - 1
            while p + 1 < e:
                if p not in cache:
                    cache[p] = lookup(arr[: p + 2], ngram[0], ngram[1], k, max_model_len)
                lk, n = cache[p]
                prop, source = fn(draft[p], conf[p], lk, n)
                a = 0
                while a < len(prop) and p + 2 + a <= e and prop[a] == ids[p + 2 + a]:
                    a += 1
                c["steps"] += 1
                c["tokens"] += min(a + 1, e - p - 1)  # a accepted + the bonus, none past the reply's end
                if prop:
                    c["drafts"] += 1
                    c["accepted"] += a
                if prop and source == "lookup":
                    c["lookup_steps"] += 1
                    c["lookup_accepted"] += a
                p += a + 1
    return out


@torch.no_grad()
def draft_proposals(model: Eagle3Draft, input_ids: torch.Tensor, aux: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [1, T], aux [1, T, n_aux*H_t] -> (ids [T, k] target ids, confidence [T]: the product of the
    k steps' top-1 probabilities), teacher-forced as `eyas.draft.simulate.draft_guesses`."""
    T = input_ids.shape[1]
    rows = [torch.ones(1, T, dtype=torch.bool, device=input_ids.device) for _ in range(k)]
    logits, _ = model(input_ids, aux, rows)  # k x [T, Vd]
    probs = [lg.float().softmax(-1).max(-1) for lg in logits]
    ids = torch.stack([model.draft_to_target(p.indices) for p in probs], dim=1)  # [T, k]
    conf = torch.stack([p.values for p in probs], dim=1).prod(dim=1)  # [T]
    return ids.cpu(), conf.cpu()


def simulate_rules(model: Eagle3Draft, samples: list[dict], k: int, rules: list[str],
                   ngram: tuple[int, int] = (2, 4), domains: list[str] | None = None) -> dict[str, dict]:
    """Counts per rule, summed over feature samples (`input_ids`, `loss_mask`, `aux_hidden_states`), and per
    domain when `domains` (one per sample) is given: {rule: {"all": counts, domain: counts, ...}}."""
    fns = {name: rule(name, k) for name in rules}
    total: dict[str, dict] = {name: {} for name in rules}
    for i, s in enumerate(samples):
        ids, conf = draft_proposals(model, s["input_ids"].view(1, -1), s["aux_hidden_states"].float()
                                    .reshape(1, s["input_ids"].shape[0], -1), k)
        got = walk_rules(ids.tolist(), conf.tolist(), s["input_ids"].tolist(), s["loss_mask"].bool().tolist(), fns, k,
                         ngram)
        for name, c in got.items():
            for key in ("all",) + ((domains[i],) if domains else ()):
                acc = total[name].setdefault(key, dict.fromkeys(c, 0))
                for x, v in c.items():
                    acc[x] += v
    return total


def tokens_per_step(c: dict[str, int]) -> float:
    return c["tokens"] / c["steps"] if c["steps"] else float("nan")
