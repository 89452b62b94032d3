"""`eyas bench quant`: what MXFP4 weights cost in quality, and how fast the quantizer is.

The target runs twice on the same held-out prose (Python's `pydoc_data.topics`, which no
quantizer step sees): once with its bf16 weights, once with every linear weight replaced
by its MXFP4 dequantization (the same `classify` rule and numerics as `eyas quantize`,
i.e. exactly the emulated copy). Both forwards compute in float32 so only the weights differ.
Reported: perplexity of each, top-1 next-token agreement, mean KL(bf16 || mxfp4) per token,
and quantizer throughput (params/s over the model's linear weights).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from eyas.models import resolve_target
from eyas.quant import mxfp4
from eyas.quant.quantize import ALWAYS_EXCLUDE, classify


def heldout_text(min_chars: int = 200_000) -> str:
    """Deterministic English prose: pydoc topics in sorted order."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return text[:min_chars]


@torch.no_grad()
def _score(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [n, T] -> (log-probs [n, T-1, V] float32, next-token nll [n, T-1])."""
    logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), dim=-1)
    nll = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    return logp, nll


@torch.no_grad()
def run_bench(target: str | Path, out: str | Path = "", tokens: int = 2048, seq_len: int = 512,
              exclude: list[str] | None = None, layers: str = "all", log=print) -> dict[str, Any]:
    """Perplexity / agreement of MXFP4 vs bf16 weights on `tokens` held-out tokens; quantizer speed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = resolve_target(str(target))
    tok = AutoTokenizer.from_pretrained(src)
    ids = tok(heldout_text(), return_tensors="pt").input_ids[0]
    n = min(tokens, len(ids)) // seq_len
    if n == 0:
        raise ValueError(f"bench quant needs at least seq_len={seq_len} tokens, got {len(ids)}")
    ids = ids[: n * seq_len].view(n, seq_len)  # [n, T]

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    logp_ref, nll_ref = zip(*(_score(model, ids[i : i + 1]) for i in range(n)))

    patterns = list(dict.fromkeys(ALWAYS_EXCLUDE + list(exclude or [])))
    t0, params = time.perf_counter(), 0
    for mname, mod in model.named_modules():  # tied lm_head shares embed_tokens: kept
        for pname, p in mod.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            kind = classify(name, tuple(p.shape), patterns, layers)
            if kind not in ("quantize", "experts"):
                continue
            # blocks of 32 run along a linear's input dim: the last one, or dim 1 of fused experts stored
            # [E, in, out] (transformers' `is_transposed` experts: gpt-oss); [E, out, in] otherwise (Qwen3-MoE)
            w = p.transpose(1, 2) if kind == "experts" and getattr(mod, "is_transposed", False) else p
            packed, scales = mxfp4.quantize(w.to(torch.bfloat16), name=name)  # the checkpoint holds bf16
            w.copy_(mxfp4.dequantize(packed, scales, torch.float32))
            params += p.numel()
    quant_s = time.perf_counter() - t0
    if params == 0:
        raise ValueError(f"{src}: no linear weight to quantize")

    agree = kl = 0.0
    nll_q = []
    for i in range(n):
        logp_q, nq = _score(model, ids[i : i + 1])
        nll_q.append(nq)
        agree += (logp_q.argmax(-1) == logp_ref[i].argmax(-1)).float().sum().item()
        kl += (logp_ref[i].exp() * (logp_ref[i] - logp_q)).sum(-1).sum().item()
    count = n * (seq_len - 1)
    result = {
        "target": str(src),
        "text": "pydoc_data.topics (sorted topics)",
        "tokens_scored": count,
        "seq_len": seq_len,
        "ppl_bf16": math.exp(torch.cat(nll_ref).mean().item()),
        "ppl_mxfp4": math.exp(torch.cat(nll_q).mean().item()),
        "top1_agreement": agree / count,
        "kl_bf16_mxfp4": kl / count,
        "quantized_params": params,
        "quantize_seconds": round(quant_s, 3),
        "quantize_mparams_per_s": round(params / quant_s / 1e6, 2),
        "torch_threads": torch.get_num_threads(),
    }
    result["ppl_ratio"] = result["ppl_mxfp4"] / result["ppl_bf16"]
    log(json.dumps(result, indent=2))
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "bench_quant.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
