"""Throughput of target + draft (and of n-gram lookup) against the target alone, per k and per
concurrency, with vLLM's own serving benchmark (`vllm.benchmarks.serve.benchmark`) against local
OpenAI servers.

Side by side on a noisy machine: the baseline server stays up for the whole call; for each k the
speculative servers (draft@k, ngram@k) start beside it, and every repeat measures each server at
each concurrency in turn (the order rotates between repeats), so each speedup is the ratio of two
readings taken minutes apart. Idle servers wait on their queues while another one runs.
Each reading also scrapes the server's `/metrics` before and after: AL = 1 + accepted / drafts
and tokens per decode step = (generated - 1 per request) / decode passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
from pathlib import Path
from typing import Any

from eyas.acceptance import counters_from_prometheus, tokens_per_decode_step
from eyas.host import engine_dtype
from eyas.vllm_runner import check_draft_servable, speculative_config

BASELINE = "baseline"


def _requests(prompts: list[list[dict]], tokenizer, max_tokens: int):
    from vllm.benchmarks.datasets import SampleRequest

    out = []
    for msgs in prompts:
        n = len(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
        out.append(SampleRequest(prompt="", prompt_len=n, expected_output_len=max_tokens, chat_messages=msgs))
    return out


def scrape(base_url: str) -> dict[str, Any]:
    """Spec-decode counters and `generated` (vllm:generation_tokens) from a server's /metrics."""
    import requests

    text = requests.get(base_url + "/metrics", timeout=30).text
    out = counters_from_prometheus(text)
    out["generated"] = int(sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
                               if line.startswith("vllm:generation_tokens_total")))
    return out


def run_serving_benchmark(base_url: str, model: str, tokenizer, prompts: list[list[dict]], max_tokens: int,
                          concurrency: int, warmups: int = 0) -> dict[str, Any]:
    """One `vllm bench serve`-equivalent run: closed loop at `concurrency`, greedy, fixed output length."""
    from vllm.benchmarks.serve import TaskType, benchmark

    before = scrape(base_url)
    reqs = _requests(prompts, tokenizer, max_tokens)
    res = asyncio.run(benchmark(
        task_type=TaskType.GENERATION, endpoint_type="openai-chat", api_url=f"{base_url}/v1/chat/completions",
        base_url=base_url, model_id=model, model_name=model, tokenizer=tokenizer, input_requests=reqs,
        logprobs=None, request_rate=float("inf"), burstiness=1.0, disable_tqdm=True, num_warmups=warmups,
        profile=False, selected_percentile_metrics=["ttft", "tpot", "itl"], selected_percentiles=[50.0, 99.0],
        ignore_eos=True, goodput_config_dict={}, max_concurrency=concurrency, lora_modules=None,
        extra_headers=None, extra_body={"temperature": 0.0},
    ))
    after = scrape(base_url)
    keep = ("completed", "duration", "output_throughput", "total_token_throughput", "mean_tpot_ms", "mean_ttft_ms")
    out = {k: res.get(k) for k in keep if k in res}
    diff = {k: after.get(k, 0) - before.get(k, 0) for k in ("num_drafts", "num_accepted_tokens", "generated")}
    out.update(diff)
    out["acceptance_length"] = 1 + diff["num_accepted_tokens"] / diff["num_drafts"] if diff["num_drafts"] else None
    out["tokens_per_decode_step"] = tokens_per_decode_step(diff["generated"], len(reqs) + warmups, diff)
    return out


def proposers(draft: Path | str | None, baselines: list[str], k: int, log=print) -> dict[str, str | Path]:
    """{name: what to serve} for the draft (when given) and each of `baselines`: `ngram[:MIN:MAX]`, `suffix`
    (skipped, with why, where arctic-inference is missing) and `hybrid[:ngram:MIN:MAX[:RULE]]` (the draft with
    prompt lookup beside it: eyas.hybrid_serve)."""
    from eyas.hybrid_serve import hybrid_method, is_hybrid, policy_of, with_policy
    from eyas.vllm_runner import SUFFIX, suffix_available

    out: dict[str, str | Path] = {}
    if draft is not None:  # the draft alone, also when its export names a lookup policy
        own = policy_of(json.loads((Path(draft) / "config.json").read_text())) if Path(draft).is_dir() else None
        out["draft"] = with_policy(draft, None) if own else draft
    for b in baselines:
        if is_hybrid(b):
            out[b] = hybrid_method(b, draft, k)
        elif b == SUFFIX and suffix_available():
            log(f"bench: {b} skipped: {suffix_available()}")
        else:
            out[b] = b
    return out


def methods_for(draft: Path | None, baselines: list[str], k: int) -> dict[str, dict | None]:
    """{name@k: speculative_config} of the speculative servers measured at this k."""
    return {f"{name}@k{k}": speculative_config(what, k) for name, what in proposers(draft, baselines, k).items()
            if name != "none"}  # the target alone is every table's baseline already


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (method, k, concurrency): median tok/s and speedup (each run over the baseline of its own repeat
    and k round), the speedups' min/max, and median AL / tokens per decode step."""
    base = {(r["k"], r["repeat"], r["concurrency"]): r["output_throughput"] for r in runs if r["method"] == BASELINE}
    groups: dict[tuple, list] = {}
    for r in runs:
        if r["method"] != BASELINE:
            groups.setdefault((r["method"], r["k"], r["concurrency"]), []).append(r)
    rows = []
    for (method, k, c), rs in sorted(groups.items(), key=lambda kv: (kv[0][0].split("@")[0], kv[0][1], kv[0][2])):
        ups = [r["output_throughput"] / base[(r["k"], r["repeat"], c)] for r in rs]

        def med(key: str):
            xs = [r[key] for r in rs if r.get(key) is not None]
            return statistics.median(xs) if xs else None

        rows.append({"method": method.split("@")[0], "k": k, "concurrency": c, "tokens_per_s": med("output_throughput"),
                     "baseline_tokens_per_s": statistics.median(base[(r["k"], r["repeat"], c)] for r in rs),
                     "speedup": statistics.median(ups), "speedup_min": min(ups), "speedup_max": max(ups),
                     "acceptance_length": med("acceptance_length"),
                     "tokens_per_decode_step": med("tokens_per_decode_step"), "repeats": len(rs)})
    return rows


def recommend(rows: list[dict[str, Any]], draft: Path | None) -> list[dict[str, Any]]:
    """Per concurrency: the (method, k) with the best median speedup, or no speculation where none beats 1.0."""
    out = []
    for c in sorted({r["concurrency"] for r in rows}):
        best = max((r for r in rows if r["concurrency"] == c), key=lambda r: r["speedup"])
        if best["speedup"] <= 1.0:
            out.append({"concurrency": c, "method": "none", "k": 0, "speedup": 1.0, "speculative_config": None})
            continue
        what = proposers(draft, [best["method"]] if best["method"] != "draft" else [], best["k"], log=lambda *a: None)
        spec = speculative_config(what[best["method"]], best["k"])
        out.append({"concurrency": c, "method": best["method"], "k": best["k"], "speedup": best["speedup"],
                    "speedup_min": best["speedup_min"], "speculative_config": spec})
    return out


def format_tables(rows: list[dict[str, Any]], rec: list[dict[str, Any]]) -> str:
    conc = sorted({r["concurrency"] for r in rows})
    keys = sorted({(r["method"], r["k"]) for r in rows})
    head = ["method", "k", "AL", "tok/step"] + [f"c={c}" for c in conc]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m, k in keys:
        mine = {r["concurrency"]: r for r in rows if (r["method"], r["k"]) == (m, k)}
        first = mine[conc[0]]
        cells = [m, str(k), f"{first['acceptance_length'] or 0:.2f}", f"{first['tokens_per_decode_step'] or 0:.2f}"]
        cells += [f"{mine[c]['speedup']:.2f}x ({mine[c]['speedup_min']:.2f}-{mine[c]['speedup_max']:.2f})"
                  if c in mine else "-" for c in conc]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| concurrency | recommended | speedup | --speculative-config |", "|---|---|---|---|"]
    for r in rec:
        cfg = f"`{json.dumps(r['speculative_config'])}`" if r["speculative_config"] else "(no speculation)"
        name = "none" if r["method"] == "none" else f"{r['method']} k={r['k']}"
        lines.append(f"| {r['concurrency']} | {name} | {r['speedup']:.2f}x | {cfg} |")
    return "\n".join(lines)


def bench_sweep(target: Path, draft: Path | None, prompts: list[list[dict]], concurrency: list[int],
                ks: list[int], baselines: list[str], max_tokens: int = 128, repeats: int = 2,
                prompts_per_level: int = 0, kv_cache_gib: float = 2.0, max_model_len: int = 2048,
                env: dict[str, str] | None = None, log=print) -> dict[str, Any]:
    """{"runs": every reading, "rows": summarize(runs), "recommended": recommend(rows), "table": markdown}."""
    from transformers import AutoTokenizer

    from eyas.synth.server import VllmServer

    tok = AutoTokenizer.from_pretrained(str(target))
    kw = dict(kv_cache_gib=kv_cache_gib, log_stats=True, dtype=engine_dtype(draft), env=env,
              max_model_len=max_model_len)  # one dtype for all: an FP8 draft needs bf16, the ratio compares like with like

    def size(c: int) -> int:
        return prompts_per_level or max(2 * c, 4)

    # Each reading (repeat, concurrency) gets prompts no earlier reading of the same server sent, the same
    # prompts for every method: suffix decoding caches every response it served, so a prompt sent again
    # would be answered from its own cached reply. Warm-ups take the prompts after the readings'.
    starts, at = {}, 0
    for rep in range(repeats):
        for c in concurrency:
            starts[rep, c], at = at, at + size(c)
    if at + 2 > len(prompts):
        log(f"bench throughput: {len(prompts)} prompts for {at + 2} requests: prompts repeat, which flatters "
            "suffix decoding (it answers a repeated prompt from its cache)", flush=True)

    def batch(c: int, start: int) -> list[list[dict]]:
        return [prompts[(start + i) % len(prompts)] for i in range(size(c))]

    warm = [prompts[(at + i) % len(prompts)] for i in range(2)]
    check_draft_servable(target, draft)  # before any server starts
    runs: list[dict[str, Any]] = []
    with VllmServer(target, **kw) as base:
        run_serving_benchmark(base.url, str(target), tok, warm, max_tokens, 1)  # warm-up, not recorded
        for k in ks:
            with contextlib.ExitStack() as stack:
                servers = {BASELINE: base}
                for name, spec in methods_for(draft, baselines, k).items():
                    srv = stack.enter_context(VllmServer(target, ["--speculative-config", json.dumps(spec)], **kw))
                    run_serving_benchmark(srv.url, str(target), tok, warm, max_tokens, 1)
                    servers[name] = srv
                names = list(servers)
                for rep in range(repeats):
                    for c in concurrency:
                        for name in names[rep % len(names):] + names[:rep % len(names)]:
                            r = run_serving_benchmark(servers[name].url, str(target), tok, batch(c, starts[rep, c]),
                                                      max_tokens, c)
                            runs.append({"method": name, "k": k, "repeat": rep, "concurrency": c, **r})
                            log(f"bench throughput: k={k} rep {rep} c={c} {name}: "
                                f"{r.get('output_throughput', 0):.1f} tok/s", flush=True)
    rows = summarize(runs)
    rec = recommend(rows, draft)
    table = format_tables(rows, rec)
    log(table, flush=True)
    return {"runs": runs, "rows": rows, "recommended": rec, "table": table, "ks": ks, "repeats": repeats,
            "max_tokens": max_tokens, "prompts": len(prompts)}


def bench_throughput(target: Path, draft: Path | None, prompts: list[list[dict]], concurrency: list[int],
                     max_tokens: int = 128, k: int = 3, prompts_per_level: int = 0,
                     kv_cache_gib: float = 2.0, out: Path | None = None, env: dict[str, str] | None = None,
                     baselines: tuple[str, ...] = (), repeats: int = 1) -> list[dict[str, Any]]:
    """One k: rows `{concurrency, baseline_tokens_per_s, spec_tokens_per_s, speedup, acceptance_length,
    tokens_per_decode_step}` (+ `<baseline>_speedup` per baseline); `env` overrides the engines' environment."""
    res = bench_sweep(target, draft, prompts, concurrency, [k], list(baselines), max_tokens, repeats,
                      prompts_per_level, kv_cache_gib, env=env)
    base = {r["concurrency"]: r["output_throughput"] for r in res["runs"] if r["method"] == BASELINE}
    rows = []
    for c in concurrency:
        row: dict[str, Any] = {"concurrency": c, "baseline_tokens_per_s": base[c]}
        for r in res["rows"]:
            if r["concurrency"] != c:
                continue
            if r["method"] == "draft":
                row.update(spec_tokens_per_s=r["tokens_per_s"], speedup=r["speedup"],
                           acceptance_length=r["acceptance_length"], tokens_per_decode_step=r["tokens_per_decode_step"])
            else:
                row.update({f"{r['method']}_tokens_per_s": r["tokens_per_s"], f"{r['method']}_speedup": r["speedup"]})
        rows.append(row)
    if out is not None:
        Path(out).write_text(json.dumps({"rows": rows, "raw": res["runs"]}, indent=2) + "\n")
    return rows
