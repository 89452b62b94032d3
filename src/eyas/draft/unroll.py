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
    mask: `ttt_mask(T, j)` for any j >= i (its first (i+1)T columns are step i's); built here if None.
    On a CPU the later steps merge a causal flash pass with their diagonal keys (`DiagonalMerge`)."""
    T, i = q.shape[2], len(ks) - 1
    gqa = ks[0].shape[1] != q.shape[1]
    if i == 0:  # step 0: plain causal attention (the kernel skips the masked blocks)
        return F.scaled_dot_product_attention(q, ks[0], vs[0], is_causal=True, enable_gqa=gqa)
    if q.device.type == "cpu":
        rep = q.shape[1] // ks[0].shape[1]
        kv = [x.repeat_interleave(rep, dim=1) if rep > 1 else x for x in ks + vs]  # [B, nh, T, D] each
        return DiagonalMerge.apply(q, kv[0], kv[i + 1], torch.stack(kv[1 : i + 1]), torch.stack(kv[i + 2 :]))
    k, v = torch.cat(ks, dim=2), torch.cat(vs, dim=2)  # [B, nkv, (i+1)T, D]
    # Elsewhere (CUDA) dense over the (i+1)T keys: (i+1)x a causal pass, cheap next to a GPU's matmuls;
    # the same merge over the efficient kernel's log-sum-exp, or flex_attention, would skip the blocks.
    mask = ttt_mask(T, i, q.device) if mask is None else mask[:, : (i + 1) * T]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class DiagonalMerge(torch.autograd.Function):
    """Step i >= 1 of the TTT attention without its masked blocks: torch's causal flash kernel over the
    step-0 keys (its log-sum-exp kept) merged with each query's own keys of steps 1..i, one dot product
    each. The dense masked pass computes all (i+1)T keys per query; this costs a causal pass plus i.
    Backward: the flash kernel's own backward given the merged output and log-sum-exp (so its
    probabilities are the merged softmax's), plus the diagonal terms by hand.

    q, k0, v0 [B, nh, T, D]; kd, vd [i, B, nh, T, D] -> [B, nh, T, D]. Equal to `attend` with the
    dense `ttt_mask` (tests/test_draft.py, values and gradients)."""

    @staticmethod
    def forward(ctx, q, k0, v0, kd, vd):  # type: ignore[override]
        scale = q.shape[-1] ** -0.5
        out0, lse0 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k0, v0, 0.0, True)
        s = (q.unsqueeze(0) * kd).sum(-1, dtype=torch.float32) * scale  # [i, B, nh, T]
        lse = torch.logsumexp(torch.cat([lse0.unsqueeze(0), s]), dim=0)  # [B, nh, T]
        w0, p = torch.exp(lse0 - lse), torch.exp(s - lse)
        out = (out0.float() * w0.unsqueeze(-1) + (p.unsqueeze(-1) * vd.float()).sum(0)).to(q.dtype)
        ctx.save_for_backward(q, k0, v0, kd, vd, out, lse, p)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k0, v0, kd, vd, out, lse, p = ctx.saved_tensors
        scale = q.shape[-1] ** -0.5
        dout = dout.contiguous()
        dq, dk0, dv0 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k0, v0, out, lse, 0.0, True)
        d32 = dout.float()
        delta = (d32 * out.float()).sum(-1)  # [B, nh, T]
        ds = p * ((d32.unsqueeze(0) * vd.float()).sum(-1) - delta) * scale  # [i, B, nh, T]
        dq = dq + (ds.unsqueeze(-1) * kd.float()).sum(0).to(dq.dtype)
        dkd = (ds.unsqueeze(-1) * q.float().unsqueeze(0)).to(kd.dtype)
        dvd = (p.unsqueeze(-1) * d32.unsqueeze(0)).to(vd.dtype)
        return dq, dk0, dv0, dkd, dvd


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
    # one mask for every step where attention is dense (a CPU merges the diagonal keys instead)
    mask = None if input_ids.device.type == "cpu" else ttt_mask(T, len(row_masks) - 1, input_ids.device)
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
