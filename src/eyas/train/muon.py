"""Muon whose Newton-Schulz iteration runs in the training's compute precision.

torch's `torch.optim.Muon` orthogonalizes every update in bf16. CPUs without native bf16
matmul (AVX2-only; no AVX512-BF16 / AMX), where eyas trains in fp32, emulate it: 27 s per
demo step against 0.7 s with AdamW on such a machine. This subclass keeps torch's Muon whole
(arguments, state layout, `state_dict`, so checkpoints move between the two): with
`ns_dtype="bf16"` it is torch's step; with "fp32" only the iteration runs in float32 (on the
demo draft's matrices 0.45 s against torch's 0.13 s where bf16 is native, so eyas uses it only
where bf16 is not). Tested against torch's own step (tests/test_train.py).
"""

from __future__ import annotations

import math

import torch


def newton_schulz(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> torch.Tensor:
    """The quintic Newton-Schulz iteration of torch's Muon, in float32.

    g: [A, B] update -> [A, B] approximately orthogonalized (singular values near 1)."""
    a, b, c = coefficients
    x = g.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, how: str | None, shape: torch.Size) -> float:
    """torch's Muon lr adjustment: "match_rms_adamw" scales to AdamW's update RMS (0.2·sqrt(max(A, B)));
    "original" / None by sqrt(max(1, A/B))."""
    a, b = shape[:2]
    return lr * (0.2 * math.sqrt(max(a, b)) if how == "match_rms_adamw" else math.sqrt(max(1, a / b)))


class Muon(torch.optim.Muon):
    """torch's Muon; with ns_dtype="fp32" its Newton-Schulz iteration runs in float32, not bf16."""

    def __init__(self, params, ns_dtype: str = "bf16", **kw) -> None:
        if ns_dtype not in ("bf16", "fp32"):
            raise ValueError(f"Muon ns_dtype must be bf16 or fp32, got {ns_dtype!r}")
        super().__init__(params, **kw)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        if self.ns_dtype == "bf16":
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
                update = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
                p.mul_(1 - lr * wd)
                p.add_(update.to(p.dtype), alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss
