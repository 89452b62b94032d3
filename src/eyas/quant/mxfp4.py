"""MXFP4 (OCP MX v1.0) numerics with Quark's default "even" scale rule, byte-exact with torchao.

A block of 32 values along the last (input) dim shares one E8M0 scale 2**(byte - 127);
each value is an E2M1 code (sign bit 3, magnitude codes 0..7 = 0, .5, 1, 1.5, 2, 3, 4, 6),
rounded half to even and clamped to +-6. Two codes per byte, element 2k in the low nibble.

Scale rule "even" (torchao `ScaleCalculationMode.EVEN`): round the block max to one mantissa
bit (a significand >= 1.75 rounds up to the next power of two), then scale =
2**(floor(log2(rounded max)) - 2), so the block max lands in [3.5, 7) before the clamp to 6.
Like torchao, the divisor never goes below the smallest normal float32 (2**-126) while the
stored byte can be 0 (2**-127): only blocks whose max is under 2**-124 see this, far below
any real weight, and they round-trip at half their value exactly as torchao's do.
"""

from __future__ import annotations

import torch

BLOCK = 32
E8M0_BIAS = 127
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude code -> value
# Midpoints between neighbouring codes; code = how many |y| passes. A tie goes to the even code:
# down at .25, 1.25, 2.5, 5 (strict >), up at .75, 1.75, 3.5 (>=). Above 5 is code 7 (6): the clamp.
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _check(w: torch.Tensor, name: str) -> None:
    if not w.is_floating_point():
        raise ValueError(f"{name}: MXFP4 quantizes floating-point tensors, got {w.dtype}")
    if w.dim() == 0 or w.shape[-1] % BLOCK:
        raise ValueError(
            f"{name}: last (input) dim of shape {tuple(w.shape)} must be divisible by the MXFP4 block size {BLOCK}; "
            f"exclude it (--exclude {name.removesuffix('.weight')})"
        )
    if not torch.isfinite(w).all():
        bad = (~torch.isfinite(w)).sum().item()
        raise ValueError(f"{name}: {bad} NaN/Inf values; refusing to quantize a corrupt tensor")


def block_scales(w_blocks: torch.Tensor) -> torch.Tensor:
    """[..., n, 32] float32 -> biased E8M0 scale bytes [..., n] (uint8), rule "even"."""
    amax = w_blocks.abs().amax(dim=-1).contiguous()
    bits = amax.view(torch.int32)
    bits = (bits + (1 << 21)) & 0x7F800000  # round the significand to 1 mantissa bit, keep the exponent
    exp = (bits >> 23) - E8M0_BIAS  # floor(log2(rounded amax)); -127 for zero / tiny blocks
    return (exp - 2 + E8M0_BIAS).clamp(0, 254).to(torch.uint8)  # 2 = floor(log2(6))


def _scale_f32(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> exact float32 powers of two (byte 0 -> 2**-127, a float32 subnormal)."""
    s = scales.to(torch.int32)
    normal = (s.clamp(min=1) << 23).view(torch.float32)
    return torch.where(s == 0, torch.full_like(normal, 2.0**-127), normal)


def quantize(w: torch.Tensor, name: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] float -> (packed uint8 [..., K/2], scales uint8 [..., K/32])."""
    _check(w, name)
    *lead, k = w.shape
    x = w.detach().to(torch.float32).reshape(*lead, k // BLOCK, BLOCK)  # [..., n, 32]
    scales = block_scales(x)  # [..., n]
    inv = (E8M0_BIAS * 2 - scales.to(torch.int32).clamp(min=1)) << 23  # 1/divisor, divisor >= 2**-126 as torchao
    y = x * inv.view(torch.float32).unsqueeze(-1)  # exact: a power-of-two scaling
    a = y.abs()
    code = torch.zeros_like(a, dtype=torch.uint8)  # E2M1 magnitude code 0..7
    for mid, tie_up in _MIDPOINTS:
        code += a >= mid if tie_up else a > mid
    code |= ((y < 0) & (code > 0)).to(torch.uint8) << 3  # sign; a result of zero is written +0
    code = code.reshape(*lead, k)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)  # element 2k low nibble, 2k+1 high nibble
    return packed.contiguous(), scales


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., K/2] -> E2M1 codes uint8 [..., K]."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(packed uint8 [..., K/2], scales uint8 [..., K/32]) -> w [..., K] in `dtype` (exact in bf16/fp32)."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 tensors must be uint8, got {packed.dtype} and {scales.dtype}")
    if packed.shape[:-1] != scales.shape[:-1] or packed.shape[-1] * 2 != scales.shape[-1] * BLOCK:
        raise ValueError(f"MXFP4 shapes disagree: packed {tuple(packed.shape)}, scales {tuple(scales.shape)}")
    codes = unpack_codes(packed).long()  # [..., K]
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
    vals = table[codes].reshape(*scales.shape, BLOCK)  # [..., n, 32]
    return (vals * _scale_f32(scales).unsqueeze(-1)).flatten(-2).to(dtype)
