"""The machine a figure came from, and how eyas sets up vLLM's engines on it (threads, dtype).

Machines of one kind differ in CPU (AMD EPYC with AVX-512 or AVX2 only, Intel Xeon with
AMX): their bf16 kernels round differently and run at different speeds, so every manifest
and every `eyas bench` output records `machine()`, and figures from two machines are never
compared blind.

vLLM CPU binds its worker to one core and reserves the rest for its frontend unless told
otherwise ("Reducing Torch threads from 2 to 1 for serving"). `vllm_env()` is the
environment eyas gives every engine it starts (in-process or spawned) and `engine_dtype()`
the dtype; `eyas bench threads` and `eyas bench drift` measured both choices.
"""

from __future__ import annotations

import functools
import json
import os
import platform
from pathlib import Path
from typing import Any

# ISA flags that change numerics (bf16 / fp16 kernels, AMX tiles) or speed on x86
NUMERIC_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8")
NATIVE_BF16 = ("avx512_bf16", "amx_bf16")  # x86 flags of CPUs that compute bf16 in hardware

# Thread layouts of vLLM CPU's engine (`eyas bench threads` runs each side by side).
THREAD_LAYOUTS: dict[str, dict[str, str]] = {
    "default": {},  # vLLM's choice: auto-bind, one core reserved for the frontend, 1 OMP thread
    "omp-all": {"OMP_NUM_THREADS": "{n}"},  # every core to torch, vLLM's binding left on
    "bind-all": {"VLLM_CPU_OMP_THREADS_BIND": "{cpus}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},  # pinned, none reserved
}
# What eyas starts its engines with. `eyas bench threads` on a 2-core AMD EPYC (AVX2), two
# repeats side by side: bind-all 1.8x vLLM's default for synthesis, 1.4x for serving at
# concurrency 1 and 4; omp-all equals the default (the log still shows the worker bound to one
# core; vLLM sets the worker's OMP_NUM_THREADS to the bound core count). README "Threads".
ENGINE_LAYOUT = "bind-all"
USER_THREAD_VARS = ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")  # set: yours win


@functools.lru_cache(maxsize=1)
def machine() -> dict[str, Any]:
    """{"cpu", "cores", "isa": [flags present of NUMERIC_FLAGS], "system"}: recorded beside every figure."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return {"cpu": model, "cores": len(os.sched_getaffinity(0)), "isa": [f for f in NUMERIC_FLAGS if f in flags],
            "system": f"{platform.system()} {platform.machine()}"}


def machine_line() -> str:
    m = machine()
    return f"{m['cpu']}, {m['cores']} cores, {' '.join(m['isa']) or 'no AVX2'}"


def thread_layout(name: str, cpus: list[int] | None = None) -> dict[str, str]:
    """The environment of layout `name` on `cpus` (default: the CPUs this process may run on)."""
    if name not in THREAD_LAYOUTS:
        raise ValueError(f"unknown thread layout {name!r}; choose one of {', '.join(THREAD_LAYOUTS)}")
    ids = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    return {k: v.format(n=len(ids), cpus=",".join(map(str, ids))) for k, v in THREAD_LAYOUTS[name].items()}


def vllm_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: os.environ) plus ENGINE_LAYOUT's settings where the user set none of them."""
    env = dict(os.environ if base is None else base)
    if not any(k in env for k in USER_THREAD_VARS):
        env.update(thread_layout(ENGINE_LAYOUT))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def apply_vllm_env() -> None:
    """For an engine built in this process: its spawned workers inherit os.environ."""
    for k, v in vllm_env().items():
        os.environ.setdefault(k, v)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def engine_dtype(draft: str | os.PathLike | None = None) -> str:
    """The dtype eyas runs the target's vLLM engines in: "bfloat16" on GPUs and on CPUs with native
    bf16, else "float32" (`EYAS_ENGINE_DTYPE` overrides). On an AVX2-only EPYC vLLM's emulated bf16
    generated 23 tok/s against float32's 83 (`eyas bench drift`), and float32 is the exact target.
    A quantized `draft` (an FP8 export) needs bf16: vLLM's fp8 method refuses float32."""
    if draft and "quantization_config" in _read_json(Path(draft) / "config.json"):
        return "bfloat16"
    if os.environ.get("EYAS_ENGINE_DTYPE"):
        dtype = os.environ["EYAS_ENGINE_DTYPE"]
        if dtype not in ("bfloat16", "float32", "float16"):
            raise ValueError(f"EYAS_ENGINE_DTYPE={dtype!r}: use bfloat16, float32 or float16")
        return dtype
    import torch

    if torch.cuda.is_available() or any(f in machine()["isa"] for f in NATIVE_BF16):
        return "bfloat16"
    return "float32"
