"""Roofline: the FLOPs a stage does per token and the peak this machine reaches, so each stage bench
can say how near the limit it runs.

- `target_flops(tcfg, context)`: FLOPs of one token through the target's forward, from its config:
  2 x the weights a token passes through (attention projections, the MLP or the experts a token is
  routed to, the LM head when logits are taken) plus attention's scores and values over `context`
  keys (2 x 2 x heads x head_dim x context per layer). A token at position i attends to i + 1 keys
  (`prefill_flops` sums them over a causal forward). Checked against torch's FlopCounterMode
  on an HF forward in tests/test_roofline.py.
- `peak_flops(dtype, threads)`: a torch.mm microbenchmark on the spot (square matrices, the best of
  a few sizes), the practical peak of this machine's cores at that dtype.
- `count_flops(fn)`: what torch's FlopCounterMode counts while `fn` runs (`eyas bench train` counts one
  micro-batch of the draft: forward and backward of the TTT unroll, the frozen target head's forward).

`eyas bench synth|extract|train` print achieved tokens/s, the FLOP/s it implies and its fraction of
the measured peak beside the machine (`fraction_line`).
"""

from __future__ import annotations

import time
from typing import Any

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def _get(tcfg: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = getattr(tcfg, n, None)
        if v is not None:
            return v
    return default


def target_weights(tcfg: Any) -> dict[str, float]:
    """Multiply-accumulates per token of each part of the forward (weights a token passes through):
    {"attn", "mlp", "lm_head"} summed over layers; MoE counts the routed experts a token goes to, the
    shared experts and the router."""
    H, L = int(tcfg.hidden_size), int(tcfg.num_hidden_layers)
    nh = int(tcfg.num_attention_heads)
    nkv = int(_get(tcfg, "num_key_value_heads", default=nh))
    hd = int(_get(tcfg, "head_dim", default=H // nh) or H // nh)
    attn = H * nh * hd + 2 * H * nkv * hd + nh * hd * H  # q, k, v, o
    dense_mlp = 3 * H * int(tcfg.intermediate_size)  # gate, up, down
    experts = int(_get(tcfg, "num_experts", "n_routed_experts", "num_local_experts", default=0) or 0)
    if experts:
        per_tok = int(_get(tcfg, "num_experts_per_tok", default=1))
        moe_i = int(_get(tcfg, "moe_intermediate_size", default=tcfg.intermediate_size))
        shared_i = int(_get(tcfg, "shared_expert_intermediate_size", default=0) or 0)
        shared_i += int(_get(tcfg, "n_shared_experts", default=0) or 0) * moe_i
        moe_mlp = per_tok * 3 * H * moe_i + 3 * H * shared_i + H * experts
        dense_layers = int(_get(tcfg, "first_k_dense_replace", default=0) or 0)
        mlp = dense_layers * dense_mlp + (L - dense_layers) * moe_mlp
    else:
        mlp = L * dense_mlp
    return {"attn": float(L * attn), "mlp": float(mlp), "lm_head": float(H * int(tcfg.vocab_size))}


def target_flops(tcfg: Any, context: float, logits: bool = True) -> float:
    """FLOPs of one token through the target attending to `context` keys (decode: its whole context;
    prefill: about half its sequence), with the LM head when `logits`."""
    w = target_weights(tcfg)
    nh = int(tcfg.num_attention_heads)
    hd = int(_get(tcfg, "head_dim", default=int(tcfg.hidden_size) // nh) or int(tcfg.hidden_size) // nh)
    scores = 2 * 2 * nh * hd * context * int(tcfg.num_hidden_layers)  # q.k and p.v
    return 2 * (w["attn"] + w["mlp"] + (w["lm_head"] if logits else 0.0)) + scores


def prefill_flops(tcfg: Any, length: int) -> float:
    """FLOPs of a causal forward over `length` tokens without logits (extraction's prefill): token i
    attends to i + 1 keys."""
    per_tok = target_flops(tcfg, 0, False)
    return length * per_tok + (target_flops(tcfg, 1, False) - per_tok) * length * (length + 1) / 2


def peak_flops(dtype: str = "float32", threads: int = 0, sizes: tuple[int, ...] = (1024, 2048),
               seconds: float = 0.5) -> dict[str, Any]:
    """The best torch.mm FLOP/s of square matrices at `dtype` on `threads` threads (0: torch's default),
    measured now: {"flops", "dtype", "threads", "n"}."""
    import torch

    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        dt = getattr(torch, DTYPES.get(dtype, dtype))
        best = (0.0, 0)
        for n in sizes:
            a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
            torch.mm(a, b)  # warm-up (oneDNN picks its kernel)
            reps, t0 = 0, time.perf_counter()
            while reps < 2 or time.perf_counter() - t0 < seconds:
                torch.mm(a, b)
                reps += 1
            best = max(best, (2 * n**3 * reps / (time.perf_counter() - t0), n))
        return {"flops": best[0], "dtype": DTYPES.get(dtype, dtype), "threads": torch.get_num_threads(), "n": best[1]}
    finally:
        torch.set_num_threads(old)


def count_flops(fn) -> float:
    """FLOPs torch's FlopCounterMode counts while `fn()` runs (matmuls and attention; elementwise ops are
    not counted)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        fn()
    return float(fc.get_total_flops())


def fraction_line(stage: str, tokens_per_s: float, flops_per_token: float, peak: dict[str, Any]) -> str:
    """One line: achieved tokens/s, the FLOP/s they imply, their share of the measured peak."""
    got = tokens_per_s * flops_per_token
    return (f"{stage}: {tokens_per_s:.0f} tokens/s x {flops_per_token / 1e9:.3f} GFLOP/token = {got / 1e9:.1f} GFLOP/s, "
            f"{100 * got / max(peak['flops'], 1e-9):.1f}% of the measured {peak['dtype']} matmul peak "
            f"({peak['flops'] / 1e9:.1f} GFLOP/s on {peak['threads']} threads, n={peak['n']})")


def roofline_fields(tokens_per_s: float, flops_per_token: float, peak: dict[str, Any]) -> dict[str, Any]:
    got = tokens_per_s * flops_per_token
    return {"flops_per_token": flops_per_token, "achieved_flops": got, "peak_flops": peak["flops"],
            "peak_dtype": peak["dtype"], "peak_threads": peak["threads"], "fraction_of_peak": got / max(peak["flops"], 1e-9)}
