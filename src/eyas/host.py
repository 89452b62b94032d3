"""The machine a figure came from, and how eyas sets up vLLM's CPU threads on it.

Machines of one kind differ in CPU (AMD EPYC without AMX, Intel Xeon with AMX): their bf16
kernels round differently and run at different speeds, so every manifest and every
`eyas bench` output records `machine()`, and figures from two machines are never
compared blind.

vLLM CPU runs its model on one OpenMP thread per worker unless told otherwise ("Reducing
Torch threads from 2 to 1 for serving"). `vllm_env()` is the environment eyas gives every
engine it starts (in-process or spawned); `eyas bench threads` measured the choice.
"""

from __future__ import annotations

import functools
import os
import platform
from typing import Any

# ISA flags that change numerics (bf16 / fp16 kernels, AMX tiles) or speed on x86
NUMERIC_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8")

# Thread layouts of vLLM CPU's engine (`eyas bench threads` runs each side by side).
THREAD_LAYOUTS: dict[str, dict[str, str]] = {
    "default": {},  # vLLM's choice: auto-bind, one core reserved for the frontend, 1 OMP thread
    "omp-all": {"OMP_NUM_THREADS": "{n}"},  # every core to torch, vLLM's binding left on
    "bind-all": {"VLLM_CPU_OMP_THREADS_BIND": "0-{last}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},  # pinned, none reserved
}
# What eyas starts its engines with (measured by `eyas bench threads`; README "Threads").
ENGINE_LAYOUT = "default"


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


def thread_layout(name: str, cores: int | None = None) -> dict[str, str]:
    """The environment of layout `name` for `cores` cores (default: the cores this process may use)."""
    if name not in THREAD_LAYOUTS:
        raise ValueError(f"unknown thread layout {name!r}; choose one of {', '.join(THREAD_LAYOUTS)}")
    n = cores or machine()["cores"]
    return {k: v.format(n=n, last=n - 1) for k, v in THREAD_LAYOUTS[name].items()}


def vllm_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: os.environ) plus ENGINE_LAYOUT's settings where the user set none of them."""
    env = dict(os.environ if base is None else base)
    layout = thread_layout(ENGINE_LAYOUT)
    if not any(k in env for k in (*layout, "OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")):
        env.update(layout)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def apply_vllm_env() -> None:
    """For an engine built in this process: its spawned workers inherit os.environ."""
    for k, v in vllm_env().items():
        os.environ.setdefault(k, v)
