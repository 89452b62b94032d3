"""FP8-E4M3 with one fp32 scale per row: the features' storage and the FP8 draft's weights.

    quantize_fp8(x [..., H])    -> (q float8_e4m3fn [..., H], scale fp32 [...]),  scale = amax / 448
    dequantize_fp8(q, scale)    -> q * scale in `dtype`
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] -> (q float8_e4m3fn [..., H], scale fp32 [...]) with one scale per row."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1).clamp_min(1e-12)  # [...]
    scale = amax / FP8_MAX
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """q [..., H], scale [...] -> q * scale [..., H] in `dtype`."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def quantize_fp8_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 (the per-row quantizer over one row): w [O, I] -> (w_fp8 [O, I], scale [] fp32)."""
    q, scale = quantize_fp8(w.reshape(1, -1))
    return q.reshape(w.shape), scale.reshape(())
