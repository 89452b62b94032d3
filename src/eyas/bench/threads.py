"""vLLM CPU's thread layouts side by side: synthesis and serving throughput per layout.

Each repeat runs every layout of `eyas.host.THREAD_LAYOUTS` in turn (the order rotates
between repeats), so each ratio to `default` is measured side by side on a noisy machine:
- synthesis: one `LLM.chat` batch of all prompts, greedy (as `eyas synth` runs them);
- serving: an OpenAI server under vLLM's own serving benchmark at each concurrency.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from eyas import vllm_runner
from eyas.host import THREAD_LAYOUTS, thread_layout


def _synthesis(target: Path, prompts: list[list[dict]], max_tokens: int, env: dict[str, str]) -> float:
    """Generated tokens/s of one offline batch."""
    spec = {"target": str(target), "max_tokens": max_tokens, "kv_cache_gib": 2, "max_model_len": 2048,
            "return_texts": False, "batches": [{"name": "synth", "conversations": prompts}]}
    b = vllm_runner.run(spec, timeout=1800, env=env)["batches"][0]
    return b["generated_tokens"] / b["seconds"]


def _serving(target: Path, prompts: list[list[dict]], max_tokens: int, concurrency: list[int],
             env: dict[str, str]) -> dict[int, float]:
    """Output tokens/s per concurrency of the plain target, from `eyas bench throughput`'s baseline."""
    from eyas.bench.throughput import bench_throughput

    rows = bench_throughput(target, None, prompts, concurrency, max_tokens, env=env)
    return {r["concurrency"]: r["baseline_tokens_per_s"] for r in rows}


def bench_threads(target: Path, prompts: list[list[dict]], concurrency: list[int], max_tokens: int = 128,
                  repeats: int = 2, layouts: list[str] | None = None) -> dict[str, Any]:
    """{"runs": [{layout, repeat, synthesis, serving}], "summary": {layout: medians and ratios to default}}."""
    names = layouts or list(THREAD_LAYOUTS)
    runs = []
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            env = thread_layout(name)
            syn = _synthesis(target, prompts, max_tokens, env)
            srv = _serving(target, prompts, max_tokens, concurrency, env)
            runs.append({"layout": name, "repeat": r, "env": env, "synthesis": syn, "serving": srv})
            print(f"bench threads: repeat {r} {name:<9} synthesis {syn:7.1f} tok/s  serving "
                  + "  ".join(f"c={c} {v:6.1f}" for c, v in srv.items()), flush=True)
    summary: dict[str, Any] = {}
    for name in names:
        mine = [x for x in runs if x["layout"] == name]
        row = {"env": thread_layout(name), "synthesis": statistics.median(x["synthesis"] for x in mine),
               "synthesis_all": [x["synthesis"] for x in mine],
               "serving": {c: statistics.median(x["serving"][c] for x in mine) for c in concurrency},
               "serving_all": {c: [x["serving"][c] for x in mine] for c in concurrency}}
        summary[name] = row
    base = summary.get("default") or summary[names[0]]
    for row in summary.values():
        row["synthesis_ratio"] = row["synthesis"] / base["synthesis"]
        row["serving_ratio"] = {c: row["serving"][c] / base["serving"][c] for c in concurrency}
    print(format_table(summary, concurrency))
    return {"runs": runs, "summary": summary, "prompts": len(prompts), "max_tokens": max_tokens}


def format_table(summary: dict[str, Any], concurrency: list[int]) -> str:
    head = "| layout | env | synthesis tok/s (x default) | " + " | ".join(f"serving c={c} (x)" for c in concurrency)
    lines = [head + " |", "|" + "---|" * (3 + len(concurrency))]
    for name, row in summary.items():
        env = " ".join(f"{k}={v}" for k, v in row["env"].items()) or "(vLLM's own)"
        cells = [f"{row['synthesis']:.1f} ({row['synthesis_ratio']:.2f}x)"]
        cells += [f"{row['serving'][c]:.1f} ({row['serving_ratio'][c]:.2f}x)" for c in concurrency]
        lines.append(f"| {name} | {env} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
