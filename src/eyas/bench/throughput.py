"""Throughput of target + draft against the target alone, per concurrency, with vLLM's own
serving benchmark (`vllm.benchmarks.serve.benchmark`) against local OpenAI servers.

Both servers run in turn on this machine, in the same call, with the same prompts, output
length (`ignore_eos`) and concurrency levels, so the speedup is a ratio measured side by
side. Acceptance comes from the spec server's `/metrics` (AL = 1 + accepted / drafts).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from eyas.host import engine_dtype
from eyas.vllm_runner import speculative_config


def _requests(prompts: list[list[dict]], tokenizer, max_tokens: int):
    from vllm.benchmarks.datasets import SampleRequest

    out = []
    for msgs in prompts:
        n = len(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
        out.append(SampleRequest(prompt="", prompt_len=n, expected_output_len=max_tokens, chat_messages=msgs))
    return out


def run_serving_benchmark(base_url: str, model: str, tokenizer, prompts: list[list[dict]], max_tokens: int,
                          concurrency: int) -> dict[str, Any]:
    """One `vllm bench serve`-equivalent run: closed loop at `concurrency`, greedy, fixed output length."""
    from vllm.benchmarks.serve import TaskType, benchmark

    reqs = _requests(prompts, tokenizer, max_tokens)
    res = asyncio.run(benchmark(
        task_type=TaskType.GENERATION, endpoint_type="openai-chat", api_url=f"{base_url}/v1/chat/completions",
        base_url=base_url, model_id=model, model_name=model, tokenizer=tokenizer, input_requests=reqs,
        logprobs=None, request_rate=float("inf"), burstiness=1.0, disable_tqdm=True, num_warmups=min(2, len(reqs)),
        profile=False, selected_percentile_metrics=["ttft", "tpot", "itl"], selected_percentiles=[50.0, 99.0],
        ignore_eos=True, goodput_config_dict={}, max_concurrency=concurrency, lora_modules=None,
        extra_headers=None, extra_body={"temperature": 0.0},
    ))
    keep = ("completed", "duration", "output_throughput", "total_token_throughput", "mean_tpot_ms", "mean_ttft_ms",
            "spec_decode_acceptance_length", "spec_decode_acceptance_rate")
    return {k: res.get(k) for k in keep if k in res}


def bench_throughput(target: Path, draft: Path | None, prompts: list[list[dict]], concurrency: list[int],
                     max_tokens: int = 128, k: int = 3, prompts_per_level: int = 0,
                     kv_cache_gib: float = 2.0, out: Path | None = None,
                     env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Rows `{concurrency, baseline_tokens_per_s, spec_tokens_per_s, speedup, acceptance_length}`;
    `env` entries override the servers' engine environment (`eyas bench threads`)."""
    from transformers import AutoTokenizer

    from eyas.synth.server import VllmServer

    tok = AutoTokenizer.from_pretrained(str(target))
    modes: dict[str, list[str]] = {"baseline": []}
    if draft is not None:
        modes["spec"] = ["--speculative-config", json.dumps(speculative_config(draft, k))]
    results: dict[str, dict[int, dict]] = {}
    for mode, extra in modes.items():
        results[mode] = {}
        # both servers at the dtype the spec one needs (an FP8 draft needs bf16): the ratio compares like with like
        with VllmServer(target, extra_args=extra, kv_cache_gib=kv_cache_gib, log_stats=True,
                        dtype=engine_dtype(draft), env=env) as srv:
            for c in concurrency:
                n = prompts_per_level or max(2 * c, 4)
                batch = [prompts[i % len(prompts)] for i in range(n)]
                results[mode][c] = run_serving_benchmark(srv.url, str(target), tok, batch, max_tokens, c)
                print(f"bench throughput: {mode} c={c}: {results[mode][c].get('output_throughput', 0):.1f} tok/s",
                      flush=True)
    rows = []
    for c in concurrency:
        base = results["baseline"][c]["output_throughput"]
        row: dict[str, Any] = {"concurrency": c, "baseline_tokens_per_s": base}
        if "spec" in results:
            sp = results["spec"][c]
            row.update(spec_tokens_per_s=sp["output_throughput"], speedup=sp["output_throughput"] / base,
                       acceptance_length=sp.get("spec_decode_acceptance_length"))
        rows.append(row)
    if out is not None:
        Path(out).write_text(json.dumps({"rows": rows, "raw": results}, indent=2) + "\n")
    return rows
