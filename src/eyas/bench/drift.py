"""How far vLLM CPU's greedy text drifts from an HF float32 forward of the same target.

Synthesis is on-policy only as far as the engine that writes the data agrees with the
target itself. vLLM generates greedy replies to real prompts in one batch (as `eyas synth`
does), per dtype; an HF forward then reads each prompt + reply teacher-forced and takes
its argmax at every generated position. A position agrees when that argmax is the token
vLLM wrote; a reply diverges at its first disagreement (where an HF float32 greedy run
would have gone another way). The HF float32 top-1 / top-2 log-prob gap at each
disagreement shows whether it was a near-tie. HF bf16 on the same text separates bf16
rounding from vLLM's kernels.

The hf synthesis engine (`synth.engine: hf`, batched and left-padded like `eyas synth` runs
it) is read the same way, and its replies are set beside vLLM's at the same dtype: the share
of replies identical token for token, and the mean length of their common start.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch

from eyas import vllm_runner

NEAR_TIE = 0.5  # nats between the float32 top-1 and top-2: below this a disagreement counts as a near-tie


def _vllm_replies(target: Path, prompts: list[list[dict]], max_tokens: int,
                  dtype: str) -> tuple[list[tuple[list, list]], float]:
    """[(prompt ids, generated ids)] from one greedy batch of vLLM at `dtype`, and its tokens/s."""
    spec = {"target": str(target), "max_tokens": max_tokens, "kv_cache_gib": 2, "max_model_len": 4096,
            "dtype": dtype, "return_texts": False, "return_token_ids": True,
            "batches": [{"name": "drift", "conversations": prompts}]}
    b = vllm_runner.run(spec, timeout=1800)["batches"][0]
    return list(zip(b["prompt_token_ids"], b["token_ids"])), b["generated_tokens"] / b["seconds"]


def agreement(model, replies: list[tuple[list, list]]) -> dict[str, Any]:
    """Teacher-forced argmax of `model` against each reply's tokens.

    replies: [(prompt ids [P], generated ids [G])]. Returns counts and, per disagreement,
    the model's top-1 / top-2 log-prob gap.
    """
    positions = agree = diverged = 0
    first: list[int] = []
    gaps: list[float] = []
    for prompt, gen in replies:
        if not gen:
            continue
        ids = torch.tensor([prompt + gen[:-1]])  # [1, P + G - 1]
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:].float()  # [G, V]: position t predicts gen[t]
        lp = logits.log_softmax(-1)
        top2 = lp.topk(2, dim=-1)
        want = torch.tensor(gen)
        hit = top2.indices[:, 0] == want  # [G]
        positions += len(gen)
        agree += int(hit.sum())
        miss = (~hit).nonzero().flatten()
        if len(miss):
            diverged += 1
            first.append(int(miss[0]))
            gaps += (top2.values[miss, 0] - top2.values[miss, 1]).tolist()
    n = sum(1 for _, g in replies if g)
    return {"positions": positions, "agree": agree, "top1_agreement": agree / max(positions, 1),
            "replies": n, "diverged": diverged, "diverged_share": diverged / max(1, n),
            "first_divergence_median": statistics.median(first) if first else None,
            "disagreements": len(gaps), "near_ties": sum(g < NEAR_TIE for g in gaps),
            "gap_median": statistics.median(gaps) if gaps else None, "gap_max": max(gaps) if gaps else None}


def _hf_engine_replies(target: Path, prompts: list[list[dict]], max_tokens: int, dtype: str,
                       batch: int = 8) -> tuple[list[tuple[list, list]], float]:
    """[(prompt ids, generated ids)] from the hf synthesis engine at `dtype` (batches of `batch`), and its tokens/s."""
    import time

    from eyas.chat import load_chat_template, render_prompt_ids
    from eyas.synth.engines import Request
    from eyas.synth.hf import HFEngine

    eng = HFEngine(target, dtype=dtype, batch=batch, max_model_len=4096)
    template = load_chat_template(target, tok=eng.tok)
    reqs = [Request(render_prompt_ids(eng.tok, p, template), max_tokens, 0) for p in prompts]
    t0 = time.perf_counter()
    gen = eng.generate_ids(reqs)
    secs = time.perf_counter() - t0
    eng.close()
    return [(r.prompt_ids, ids) for r, (ids, _) in zip(reqs, gen)], sum(len(ids) for ids, _ in gen) / secs


def same_replies(a: list[tuple[list, list]], b: list[tuple[list, list]]) -> dict[str, Any]:
    """How alike two engines' replies to the same prompts are: identical share, mean common start."""
    assert [p for p, _ in a] == [p for p, _ in b], "the two engines ran different prompt ids"
    common = [next((i for i, (x, y) in enumerate(zip(ga, gb)) if x != y), min(len(ga), len(gb)))
              for (_, ga), (_, gb) in zip(a, b)]
    return {"identical_share": sum(ga == gb for (_, ga), (_, gb) in zip(a, b)) / max(1, len(a)),
            "common_start_mean": statistics.mean(common) if common else 0.0}


def bench_drift(target: Path, prompts: list[list[dict]], max_tokens: int = 128,
                engine_dtypes: tuple[str, ...] = ("bfloat16", "float32"), hf_engine: bool = True) -> dict[str, Any]:
    """Rows {engine dtype, reference dtype, agreement...}: vLLM text at each dtype against HF fp32 (and HF bf16);
    with `hf_engine`, the hf synthesis engine's text at each dtype too, beside vLLM's at that dtype."""
    from transformers import AutoModelForCausalLM

    replies = {f"vllm-{dt}": _vllm_replies(target, prompts, max_tokens, dt) for dt in engine_dtypes}
    if hf_engine:
        replies |= {f"hf-engine-{dt}": _hf_engine_replies(target, prompts, max_tokens, dt) for dt in engine_dtypes}
    rows = []
    for ref in ("float32", "bfloat16"):
        model = AutoModelForCausalLM.from_pretrained(str(target), dtype=getattr(torch, ref)).eval()
        for name, (rep, speed) in replies.items():
            dt = name.rsplit("-", 1)[1]
            if ref == "bfloat16" and dt != "bfloat16":
                continue
            row = {"engine": name, "reference": f"hf-{ref}", "engine_tokens_per_s": speed, **agreement(model, rep)}
            if name.startswith("hf-engine-") and f"vllm-{dt}" in replies:
                row["vs_vllm_same_dtype"] = same_replies(rep, replies[f"vllm-{dt}"][0])
            rows.append(row)
            print(f"bench drift: {name} vs hf {ref}: top-1 agreement {100 * row['top1_agreement']:.2f}% "
                  f"over {row['positions']} positions; {row['diverged']}/{row['replies']} replies diverge within "
                  f"{max_tokens} tokens; {row['near_ties']}/{row['disagreements']} disagreements are near-ties "
                  f"(gap < {NEAR_TIE} nats); {name} generated {speed:.1f} tok/s"
                  + (f"; {100 * row['vs_vllm_same_dtype']['identical_share']:.0f}% of its replies identical to "
                     f"vllm-{dt}'s" if "vs_vllm_same_dtype" in row else ""), flush=True)
        del model
    return {"rows": rows, "prompts": len(prompts), "max_tokens": max_tokens, "near_tie_nats": NEAR_TIE}
