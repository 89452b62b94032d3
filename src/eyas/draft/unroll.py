"""The TTT unroll: K draft steps over whole sequences, attending as vLLM's KV cache does.

Worked example (T = 4, step i = 2): the query at index p sees the step-0 keys 0..p (the
verified prefix, causal) and, of steps 1 and 2, only index p (its own chain):

    keys:      step 0        step 1      step 2
    p=0:     1 0 0 0       1 0 0 0     1 0 0 0
    p=1:     1 1 0 0       0 1 0 0     0 1 0 0
    p=2:     1 1 1 0       0 0 1 0     0 0 1 0
    p=3:     1 1 1 1       0 0 0 1     0 0 0 1

`Eagle3Draft.forward` is `unroll` (FSDP2 gathers the parameters around forward); the loss
over its logits is `eyas.draft.ttt`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from eyas.draft.model import Eagle3Draft


def shift_left(x: torch.Tensor, n: int, fill: int | bool = 0) -> torch.Tensor:
    """[B, T] -> out[:, p] = x[:, p + n] (fill past the end)."""
    if n == 0:
        return x
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


def ttt_mask(T: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[T, (step+1)*T] bool: causal over the step-0 keys, then one diagonal per later step."""
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    eye = torch.eye(T, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=1)


def attend(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor],
           mask: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, nh, T, D]; ks/vs: step 0..i keys/values [B, nkv, T, D] -> [B, nh, T, D].
    mask: `ttt_mask(T, j)` for any j >= i (its first (i+1)T columns are step i's); built here if None."""
    T, i = q.shape[2], len(ks) - 1
    k, v = torch.cat(ks, dim=2), torch.cat(vs, dim=2)  # [B, nkv, (i+1)T, D]
    gqa = ks[0].shape[1] != q.shape[1]
    if i == 0:  # step 0: plain causal attention (the kernel skips the masked blocks)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    # Dense over the (i+1)T keys: i diagonal blocks cost (i+1)x a causal pass. Fine for chat-length
    # sequences; for long ones a block-sparse kernel (flex_attention) or an LSE merge would skip them.
    mask = ttt_mask(T, i, q.device) if mask is None else mask[:, : (i + 1) * T]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def unroll(
    model: Eagle3Draft, input_ids: torch.Tensor, aux: torch.Tensor, row_masks: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Run len(row_masks) TTT steps over right-padded sequences.

    input_ids [B, T]; aux [B, T, n_aux*H_t]; row_masks[i] [B, T] bool selects the indices whose
    step-i logits are wanted. Returns (logits per step [n_i, Vd], pre-norm outputs per step [B, T, H]).
    """
    B, T = input_ids.shape
    pos = torch.arange(T, device=input_ids.device).expand(B, T)
    hidden = model.combine_hidden_states(aux)  # [B, T, H]
    mask = ttt_mask(T, len(row_masks) - 1, input_ids.device)  # one mask for every step
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    logits, prenorms = [], []
    for i, rows in enumerate(row_masks):
        q, k, v, residual = model.qkv(shift_left(input_ids, 1 + i), hidden, pos + i)
        ks.append(k)
        vs.append(v)
        pre = model.after_attention(attend(q, ks, vs, mask), residual)  # [B, T, H]
        logits.append(model.compute_logits(pre[rows]))  # [n_i, Vd]
        prenorms.append(pre)
        hidden = model.feedback(pre)
    return logits, prenorms
