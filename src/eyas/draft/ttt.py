"""Training-time test (TTT): unroll the draft K steps as vLLM runs it, with a soft-CE loss.

Shift convention (vLLM `set_inputs_first_pass`: input ids rotated left by one, positions
and hidden states unchanged). For a sequence x_0..x_{T-1} with target hidden states h_t:

    step 0, index p:  hidden = fc(aux_p),            token x_{p+1}, position p     -> predicts x_{p+2}
    step i, index p:  hidden = step i-1 out at p,    token x_{p+1+i}, position p+i -> predicts x_{p+2+i}

Index p of step i is the i-th speculative token of a chain whose last verified token is
x_{p+1}. Attention (vLLM's KV cache during that chain): the query of step i at p sees the
step-0 keys of indices 0..p (the real prefix) and the keys of steps 1..i at index p only
(the diagonal). The loss of step i at p is taken when x_{p+2+i} is a loss token; its
soft label is the target's distribution at position p+1+i (from `last_hidden_states`
through the target's lm_head) restricted to the draft vocab and renormalized.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from eyas.draft.unroll import shift_left

if TYPE_CHECKING:
    from eyas.draft.model import Eagle3Draft


# ---------------------------------------------------------------------------------------------
# the frozen target side: lm_head (soft labels, top-1) and token embeddings


class TargetHead:
    """Frozen target lm_head: soft labels over the draft vocab and the full-vocab top-1."""

    def __init__(self, lm_head: torch.Tensor, draft_ids: torch.Tensor, softcap: float | None = None,
                 logit_scale: float = 1.0, chunk_rows: int = 0, timed: bool = False):
        self.timed, self.seconds = timed, 0.0  # timed: `seconds` sums the wall time of `labels` (benchmarks)
        self.weight = lm_head.detach()  # [V, H]
        self.draft_ids = draft_ids.to(lm_head.device)  # [Vd]
        self.weight_d = self.weight[self.draft_ids]  # [Vd, H]
        self.t2d = torch.zeros(lm_head.shape[0], dtype=torch.bool, device=lm_head.device)
        self.t2d[self.draft_ids] = True
        if logit_scale <= 0:
            raise ValueError(f"target logit_scale must be > 0, got {logit_scale}")
        self.softcap, self.scale = softcap, logit_scale
        self.chunk_rows = chunk_rows or max(1, (1 << 25) // lm_head.shape[0])

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> TargetHead:
        w = self.weight.to(device=device, dtype=dtype or self.weight.dtype)
        return TargetHead(w, self.draft_ids.to(device), self.softcap, self.scale, self.chunk_rows, self.timed)

    def _post(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float() * self.scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @torch.no_grad()
    def labels(self, last: torch.Tensor, top1: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """last [R, H] (final normed target states) -> (q [R, Vd] fp32 probs over the draft vocab,
        top [R] int64 target ids of the target's full-vocab argmax, or None without `top1`: the
        full-vocab product is most of this call's cost)."""
        if not self.timed:
            return self._labels(last, top1)
        sync = torch.cuda.synchronize if last.is_cuda else (lambda: None)
        sync()
        t0 = time.perf_counter()
        out = self._labels(last, top1)
        sync()
        self.seconds += time.perf_counter() - t0
        return out

    def _labels(self, last: torch.Tensor, top1: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = last.to(self.weight.dtype)
        q = torch.softmax(self._post(x @ self.weight_d.T), dim=-1)
        if not top1:
            return q, None
        top = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
        # [chunk, V] at a time, argmax of the raw logits (scale > 0 and softcap keep the order)
        for s in range(0, x.shape[0], self.chunk_rows):
            top[s : s + self.chunk_rows] = (x[s : s + self.chunk_rows] @ self.weight.T).argmax(-1)
        return q, top


# ---------------------------------------------------------------------------------------------
# loss and raw counts


@dataclass
class Batch:
    """A right-padded micro-batch (what `eyas.train.data` yields)."""

    input_ids: torch.Tensor  # [B, T] int64
    loss_mask: torch.Tensor  # [B, T] bool, False on padding
    aux: torch.Tensor  # [B, T, n_aux*H_t]
    last: torch.Tensor  # [B, T, H] final normed target states
    num_tokens: int = 0  # real (unpadded) tokens

    def to(self, device: torch.device | str) -> Batch:
        return Batch(*(t.to(device, non_blocking=True) for t in (self.input_ids, self.loss_mask, self.aux, self.last)),
                     num_tokens=self.num_tokens)


STAT_KEYS = ("loss_sum", "rows", "scored", "correct", "cond_den", "cond_num", "in_vocab", "ent_sum")


def step_masks(loss_mask: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Row masks per step: index p of step i is trained when x_{p+2+i} is a loss token."""
    return [shift_left(loss_mask, 2 + i, False) for i in range(steps)]


def row_objective(logp: torch.Tensor, q: torch.Tensor, loss: str = "kl", hard: float = 0.0) -> torch.Tensor:
    """logp [n, Vd] draft log-probs, q [n, Vd] target probs -> [n] per-row objective.

    kl: the soft CE -Σ q log p (the KL to the target up to q's entropy, a constant).
    lk: -log Σ_v min(p_v, q_v), the negative log of the acceptance probability of a sampled
        proposal (1 - total variation; the "LK" loss of Samarin et al. 2026), whose gradient is
        TV's scaled by 1/α, so it does not vanish where the draft is far off.
    hard mixes in, with weight `hard`, the CE against q's argmax: greedy verification accepts
    exactly argmax agreement."""
    if loss == "kl":
        obj = -(q * logp).sum(-1)
    elif loss == "lk":
        obj = -torch.log(torch.minimum(logp.exp(), q).sum(-1).clamp_min(1e-6))
    else:
        raise ValueError(f"unknown loss {loss!r}: kl or lk")
    if hard:
        obj = (1 - hard) * obj - hard * logp.gather(-1, q.argmax(-1, keepdim=True)).squeeze(-1)
    return obj


def ttt_loss(
    model: Eagle3Draft, batch: Batch, head: TargetHead, steps: int, decay: float, score: bool = True,
    hard: float = 0.0, loss: str = "kl", min_prob: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Σ_i decay^i · mean objective of step i (`row_objective`: soft CE or LK, with `hard` of the
    argmax CE), and raw counts per step (float64 [steps] each). With `min_prob`, only rows where the
    target's top probability over the draft vocab reaches it are trained (the peaked positions a draft
    can hope to match; flat ones are noise to it); the counts still cover every row. The counts are
    loss_sum, rows, ent_sum (entropy of the soft labels: the floor of loss_sum; loss_sum - ent_sum
    is the KL) and, when `score` (the target's full-vocab top-1 is computed), scored (= rows),
    correct (draft top-1 == target top-1), cond_den/cond_num (same, among rows whose steps
    0..i-1 were all right), in_vocab (target top-1 inside the draft vocab); zeros otherwise."""
    masks = step_masks(batch.loss_mask, steps)
    tmask = shift_left(batch.loss_mask, 1, False)  # target position j is needed when x_{j+1} is a loss token
    q, top = head.labels(batch.last[tmask], top1=score)  # [R, Vd], [R] or None
    ent = -(q * torch.log(q.clamp_min(1e-30))).sum(-1)  # [R]
    rowmap = torch.full(tmask.shape, -1, dtype=torch.int64, device=tmask.device)
    rowmap[tmask] = torch.arange(q.shape[0], device=tmask.device)
    logits, _ = model(batch.input_ids, batch.aux, masks)
    dev = batch.input_ids.device
    stats = {k: torch.zeros(steps, dtype=torch.float64, device=dev) for k in STAT_KEYS}
    chain = torch.ones_like(batch.loss_mask)  # steps 0..i-1 all valid and right at index p
    total = torch.zeros((), device=dev)
    for i, (lg, m) in enumerate(zip(logits, masks)):
        r = shift_left(rowmap, 1 + i, -1)[m]  # [n_i] rows of q/top for step i (>= 0: m implies tmask there)
        logp = torch.log_softmax(lg.float(), dim=-1)
        qr = q[r]  # [n_i, Vd]
        ce = -(qr * logp).sum(-1)  # [n_i]
        n = ce.numel()
        obj = ce if loss == "kl" and not hard else row_objective(logp, qr, loss, hard)
        if min_prob:
            keep = qr.amax(-1) >= min_prob
            obj, n_obj = obj[keep], int(keep.sum())
        else:
            n_obj = n
        total = total + (decay**i) * obj.sum() / max(n_obj, 1)
        with torch.no_grad():
            stats["loss_sum"][i] = ce.detach().sum()
            stats["rows"][i] = n
            stats["ent_sum"][i] = ent[r].sum()
            if top is None:
                continue
            guess = model.draft_to_target(lg.argmax(-1))
            ok = guess == top[r]
            okm = torch.zeros_like(m)
            okm[m] = ok
            stats["scored"][i] = n
            stats["correct"][i] = ok.sum()
            stats["cond_den"][i] = (m & chain).sum()
            stats["cond_num"][i] = (m & chain & okm).sum()
            stats["in_vocab"][i] = head.t2d[top[r]].sum()
            chain = chain & m & okm
    return total, stats
