"""Simulated acceptance: vLLM's greedy verification replayed on teacher-forced data.

On greedy on-policy data the target's continuation *is* the data, so a draft's chain can be
scored without running the target: the chain drafted after verified token x_{p+1} is the
TTT unroll at index p (step i predicts x_{p+2+i}, teacher-forced, which is what the draft
sees as long as its earlier guesses were accepted). Verification accepts up to the first
mismatch and adds the target's bonus token, so the next chain starts a + 1 tokens later:

    for each generated span [s, e] (one request's reply: x_s sampled by the prefill, x_e the last):
        p = s - 1                              # the first draft follows the prefill
        while p + 1 < e:                       # the request is still running after x_{p+1}
            a = leading i < k with p+2+i <= e and draft_i(p) == x_{p+2+i}
            num_drafts += 1; accepted_per_pos[:a] += 1
            p += a + 1                         # a accepted tokens + the bonus token

Worked example, k = 3, span [3, 9], a draft that is always right: p = 2 accepts x4..x6 (+ bonus
x7), p = 6 accepts x8, x9 (nothing past x9 counts), then x9 ends the request: 2 drafts,
accepted_per_pos [2, 2, 1], AL = 1 + 5/2 = 3.5 for the 7 generated tokens (1 + 4 + 2).

The counters have vLLM's names, so `eyas.acceptance.summarize` turns them into AL and
per-position rates exactly as it does vLLM's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from eyas.draft.model import Eagle3Draft


@torch.no_grad()
def draft_guesses(model: Eagle3Draft, input_ids: torch.Tensor, aux: torch.Tensor, k: int) -> torch.Tensor:
    """input_ids [B, T], aux [B, T, n_aux*H_t] -> [k, B, T] target ids: the draft's greedy
    step-i token at index p (its guess for x_{p+2+i})."""
    B, T = input_ids.shape
    rows = [torch.ones(B, T, dtype=torch.bool, device=input_ids.device) for _ in range(k)]
    logits, _ = model(input_ids, aux, rows)  # k x [B*T, Vd]
    return torch.stack([model.draft_to_target(lg.argmax(-1)).view(B, T) for lg in logits])


def spans(generated: torch.Tensor) -> list[tuple[int, int]]:
    """generated [T] bool -> (first, last) index of every maximal run of True."""
    g = generated.to(torch.int8).tolist()
    out, start = [], None
    for t, v in enumerate(g + [0]):
        if v and start is None:
            start = t
        elif not v and start is not None:
            out.append((start, t - 1))
            start = None
    return out


def walk(guesses: torch.Tensor, ids: torch.Tensor, generated: torch.Tensor) -> tuple[int, list[int]]:
    """One sequence: guesses [k, T], ids [T], generated [T] bool -> (num_drafts, accepted_per_pos [k])."""
    k = guesses.shape[0]
    right = torch.zeros_like(guesses, dtype=torch.bool)  # right[i, p]: draft_i(p) == x_{p+2+i}
    T = ids.shape[0]
    for i in range(k):
        n = T - 2 - i
        if n > 0:
            right[i, :n] = guesses[i, :n] == ids[2 + i:]
    right = right.tolist()
    drafts, per_pos = 0, [0] * k
    for s, e in spans(generated):
        p = s - 1
        while p + 1 < e:
            drafts += 1
            a = 0
            while a < k and p + 2 + a <= e and right[a][p]:
                per_pos[a] += 1
                a += 1
            p += a + 1
    return drafts, per_pos


def simulate_acceptance(model: Eagle3Draft, input_ids: torch.Tensor, aux: torch.Tensor, generated: torch.Tensor,
                        k: int) -> dict[str, object]:
    """vLLM-named counters for a right-padded batch: input_ids [B, T], aux [B, T, n_aux*H_t],
    generated [B, T] bool (the tokens the target generated: False on prompts and padding)."""
    guesses = draft_guesses(model, input_ids, aux, k).cpu()
    ids, gen = input_ids.cpu(), generated.cpu()
    drafts, per_pos = 0, [0] * k
    for b in range(ids.shape[0]):
        d, pp = walk(guesses[:, b], ids[b], gen[b])
        drafts += d
        per_pos = [x + y for x, y in zip(per_pos, pp)]
    return {"num_drafts": drafts, "num_draft_tokens": drafts * k, "num_accepted_tokens": sum(per_pos),
            "accepted_per_pos": per_pos}


def simulate_samples(model: Eagle3Draft, samples: list[dict], k: int, max_len: int = 0,
                     device: torch.device | str = "cpu") -> dict[str, object]:
    """`simulate_acceptance` summed over feature samples (`input_ids`, `loss_mask`, `aux_hidden_states`),
    one at a time, each cut to `max_len` (0: whole)."""
    total = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": [0] * k}
    for s in samples:
        T = min(int(s["input_ids"].shape[0]), max_len or int(s["input_ids"].shape[0]))
        c = simulate_acceptance(model, s["input_ids"][:T].view(1, T).to(device),
                                s["aux_hidden_states"][:T].float().reshape(1, T, -1).to(device),
                                s["loss_mask"][:T].view(1, T), k)
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            total[key] += c[key]
        total["accepted_per_pos"] = [a + b for a, b in zip(total["accepted_per_pos"], c["accepted_per_pos"])]
    return total
