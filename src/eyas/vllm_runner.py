"""Run a vLLM `LLM` in a fresh process and write JSON results, so callers never hold vLLM.

    python -m eyas.vllm_runner SPEC.json RESULT.json

SPEC: {"target", "draft" (null: plain decoding), "k", "max_tokens", "temperature",
"max_model_len", "kv_cache_gib", "enforce_eager", "seed", "dtype", "return_token_ids", "ignore_eos",
"draft_sample_method", "request_seed" (null: each request its own random stream; default: "seed"),
"batches": [{"name", "conversations": [[{"role", "content"}, ...], ...]}]}.
Each batch runs as one `LLM.chat` call (greedy when temperature is 0) in the same engine;
the spec-decode counters are read before and after it and the difference is the batch's.
RESULT: {"load_seconds", "batches": [{"name", "n", "seconds", "prompt_tokens",
"generated_tokens", "counters": {num_drafts, num_draft_tokens, num_accepted_tokens,
accepted_per_pos}, "texts" (+ "prompt_token_ids", "token_ids" with return_token_ids)}], ...}.
`run(spec)` does the spawning from any process.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from eyas.children import scratch_prefix
from eyas.host import engine_dtype, vllm_env
from eyas.io import atomic_write_text
from eyas.vllm_fixes import DraftNotServable, draft_limit, engine_options

COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
ENGINE_UP = "eyas.vllm_runner: engine up"
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")


NGRAM = "ngram"  # a draft spelled `ngram` or `ngram:MIN:MAX`: vLLM's prompt lookup, the no-training baseline
NGRAM_DEFAULT = (2, 4)  # n-gram lengths looked up in the context, longest first


SUFFIX = "suffix"  # vLLM's suffix decoding (Arctic Inference's suffix trees over the prompt and past replies)


def is_ngram(draft: str | os.PathLike | None) -> bool:
    return draft is not None and (str(draft) == NGRAM or str(draft).startswith(NGRAM + ":"))


def is_lookup(draft: str | os.PathLike | None) -> bool:
    """A proposer named by a string, no draft dir: n-gram prompt lookup or suffix decoding."""
    return is_ngram(draft) or (draft is not None and str(draft) == SUFFIX)


def suffix_available() -> str | None:
    """None when vLLM's suffix decoding can run here, else why not (it needs the arctic-inference package)."""
    import importlib.util

    if importlib.util.find_spec("arctic_inference") is None:
        return ("suffix decoding needs the arctic-inference package (source-only on PyPI: C++ with nanobind); "
                "scripts/build_arctic.sh builds and installs it without touching vLLM's dependencies")
    return None


def check_draft_servable(target: str | os.PathLike, draft: str | os.PathLike | None) -> None:
    """Raise DraftNotServable before vLLM starts when the EAGLE-3 `draft` cannot be served beside
    `target` on this machine (None and n-gram always can)."""
    why = None if draft is None or is_lookup(draft) else draft_limit(target)
    if draft is not None and str(draft) == SUFFIX:
        why = suffix_available()
    if why:
        raise DraftNotServable(why)


def ngram_lengths(draft: str) -> tuple[int, int]:
    """`ngram` -> NGRAM_DEFAULT; `ngram:MIN:MAX` -> (MIN, MAX), checked."""
    if draft == NGRAM:
        return NGRAM_DEFAULT
    parts = draft.split(":")[1:]
    try:
        lo, hi = (int(x) for x in parts)
    except ValueError:
        lo = hi = 0
    if not 1 <= lo <= hi:
        raise ValueError(f"draft {draft!r}: write ngram or ngram:MIN:MAX with 1 <= MIN <= MAX (e.g. ngram:2:4)")
    return lo, hi


def speculative_config(draft: str | os.PathLike, k: int) -> dict[str, Any]:
    """The `speculative_config` that proposes `k` tokens: an EAGLE-3 head in the directory `draft`,
    or vLLM's n-gram prompt lookup when `draft` is `ngram[:MIN:MAX]`."""
    if is_ngram(draft):
        lo, hi = ngram_lengths(str(draft))
        return {"method": "ngram", "num_speculative_tokens": int(k), "prompt_lookup_min": lo, "prompt_lookup_max": hi}
    if str(draft) == SUFFIX:
        return {"method": "suffix", "num_speculative_tokens": int(k)}
    return {"method": "eagle3", "model": str(draft), "num_speculative_tokens": int(k)}


def read_counters(llm) -> dict[str, Any]:
    """Spec-decode counters summed over engines/labels; {} keys absent when spec decoding is off."""
    from vllm.v1.metrics.reader import Counter, Vector

    out: dict[str, Any] = {}
    for m in llm.get_metrics():
        if isinstance(m, Counter) and m.name in COUNTERS:
            out[COUNTERS[m.name]] = out.get(COUNTERS[m.name], 0) + int(m.value)
        elif isinstance(m, Vector) and m.name == PER_POS:
            prev = out.get("accepted_per_pos") or [0] * len(m.values)
            out["accepted_per_pos"] = [a + int(b) for a, b in zip(prev, m.values)]
    return out


def diff_counters(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    d = {k: after[k] - before.get(k, 0) for k in COUNTERS.values() if k in after}
    if "accepted_per_pos" in after:
        prev = before.get("accepted_per_pos") or [0] * len(after["accepted_per_pos"])
        d["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], prev)]
    return d


def _engine(spec: dict[str, Any]):
    from vllm import LLM

    kw: dict[str, Any] = dict(
        model=spec["target"],
        max_model_len=int(spec.get("max_model_len", 2048)),
        disable_log_stats=False,
        seed=int(spec.get("seed", 0)),
        enforce_eager=bool(spec.get("enforce_eager", True)),
        max_num_seqs=int(spec.get("max_num_seqs", 64)),
        dtype=spec.get("dtype") or engine_dtype(None if is_lookup(spec.get("draft")) else spec.get("draft")),
    )
    if spec.get("gpu_memory_utilization"):
        kw["gpu_memory_utilization"] = float(spec["gpu_memory_utilization"])
    if spec.get("draft"):
        kw["speculative_config"] = speculative_config(spec["draft"], int(spec.get("k", 3)))
        if spec.get("draft_sample_method"):  # greedy (vLLM's default) | probabilistic: verify against its probabilities
            kw["speculative_config"]["draft_sample_method"] = spec["draft_sample_method"]
    kw.update(engine_options(spec["target"]))
    return LLM(**kw)


def main(spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    from vllm import SamplingParams

    t0 = time.perf_counter()
    llm = _engine(spec)
    load_s = time.perf_counter() - t0
    print(ENGINE_UP, flush=True)  # run(): a failure after this line is not the process layout's
    params = SamplingParams(
        max_tokens=int(spec.get("max_tokens", 128)),
        temperature=float(spec.get("temperature", 0.0)),
        seed=None if "request_seed" in spec and spec["request_seed"] is None else int(spec.get("seed", 0)),
        ignore_eos=bool(spec.get("ignore_eos", False)),
    )
    result: dict[str, Any] = {"load_seconds": load_s, "batches": [], "spec": {k: v for k, v in spec.items() if k != "batches"}}
    for batch in spec["batches"]:
        before, hyb_before = read_counters(llm), _hybrid_stats()
        t = time.perf_counter()
        outs = llm.chat(batch["conversations"], params, use_tqdm=False)
        secs = time.perf_counter() - t
        after = read_counters(llm)
        result["batches"].append(
            {
                "name": batch["name"],
                "n": len(outs),
                "seconds": secs,
                "prompt_tokens": sum(len(o.prompt_token_ids or []) for o in outs),
                "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                "counters": diff_counters(after, before),
                "texts": [o.outputs[0].text for o in outs] if spec.get("return_texts", True) else [],
            }
        )
        if hyb_before is not None:  # the draft served with prompt lookup beside it (eyas.hybrid_serve)
            now = _hybrid_stats() or {}
            result["batches"][-1]["hybrid"] = {s: {x: now.get(s, {}).get(x, 0) - hyb_before.get(s, {}).get(x, 0)
                                                   for x in ("steps", "accepted")} for s in ("draft", "lookup")}
        if spec.get("return_token_ids"):
            result["batches"][-1].update(prompt_token_ids=[list(o.prompt_token_ids) for o in outs],
                                         token_ids=[list(o.outputs[0].token_ids) for o in outs])
    atomic_write_text(result_path, json.dumps(result))


def _hybrid_stats() -> dict[str, Any] | None:
    """The hybrid's per-source counts so far (EYAS_HYBRID_STATS, written by the worker each step), {} before
    its first step; None when no stats file was asked for."""
    path = os.environ.get("EYAS_HYBRID_STATS")
    if not path:
        return None
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def root_causes(log_text: str, n: int = 8) -> str:
    """The distinct `SomethingError: message` lines of a log (the worker's root cause is not at its end)."""
    seen: list[str] = []
    for line in log_text.splitlines():
        m = re.search(r"\b[A-Za-z_.]*(Error|Exception): .*", line)
        if m and m.group(0) not in seen:
            seen.append(m.group(0))
    return "\n".join(seen[-n:]) or "(none found)"


def run(spec: dict[str, Any], timeout: float = 3600, log_path: str | os.PathLike | None = None,
        env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `spec` in a fresh `python -m eyas.vllm_runner` process; returns its result dict.

    The engine's log goes to `log_path` (a temp file when None); a failure raises
    RuntimeError carrying the log's tail. `env` entries override eyas's engine environment.
    """
    check_draft_servable(spec["target"], spec.get("draft"))
    # a caller under torchrun (serve-eval from the trainer) must not hand its process-group env to vLLM
    env = {**vllm_env({k: v for k, v in os.environ.items()
                       if k not in TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}), **(env or {})}
    # the engine core and its one worker inside the runner process (vLLM's uni executor), not two more spawned
    # processes that import torch and vLLM again: the same counters and texts, ~20 s less per engine (2026-12-06,
    # AMD EPYC avx512_bf16: start 5.4-6.7 s against 20.5-22.5 s; docs/tokens-per-hour.md). Yours wins if set.
    # vLLM 0.32 CPU cannot start some engines that way (its kernel-override scan trips on modules the caller
    # imported: llvmlite's, with the Kimi-K2.5 tiny target): a start that fails in-process runs again multiprocess.
    if "VLLM_ENABLE_V1_MULTIPROCESSING" not in env:
        try:
            return _run(spec, timeout, log_path, {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, retry_unstarted=True)
        except _NotStarted:
            pass
    return _run(spec, timeout, log_path, env)


class _NotStarted(Exception):
    """The in-process engine did not come up (no ENGINE_UP in its log)."""


def _run(spec: dict[str, Any], timeout: float, log_path: str | os.PathLike | None, env: dict[str, str],
         retry_unstarted: bool = False) -> dict[str, Any]:
    if spec.get("kv_cache_gib"):
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(float(spec["kv_cache_gib"]))))  # whole GiB
    # named after this process: its watchdog removes the dir if eyas is killed while the engine runs
    with tempfile.TemporaryDirectory(prefix=scratch_prefix("vllm")) as tmp:
        sp, rp = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        sp.write_text(json.dumps(spec))
        log = Path(log_path) if log_path else Path(tmp) / "vllm.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as lf:
            proc = subprocess.Popen(
                [sys.executable, "-m", "eyas.vllm_runner", str(sp), str(rp)],
                stdout=lf, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
                rc = None
        if rc != 0 or not rp.exists():
            text = log.read_text(errors="replace")
            if retry_unstarted and rc is not None and ENGINE_UP not in text:
                print(f"eyas: vLLM did not start in-process ({root_causes(text, 1)}); starting it multiprocess",
                      file=sys.stderr, flush=True)
                raise _NotStarted()
            why = "timed out" if rc is None else f"exited with {rc}"
            raise RuntimeError(
                f"vLLM runner {why} (target {spec.get('target')}, draft {spec.get('draft')}); log {log}\n"
                f"errors:\n{root_causes(text)}\nlog tail:\n{text[-3000:]}"
            )
        return json.loads(rp.read_text())


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print("usage: python -m eyas.vllm_runner SPEC.json RESULT.json", file=sys.stderr)
        sys.exit(2)
    main(sys.argv[1], sys.argv[2])
