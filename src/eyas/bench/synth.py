"""`eyas bench synth`: synthesis throughput of `eyas synth` itself, per setting, side by side, against
this machine's roofline.

Each row is the recipe's `synth` section with its overrides (`bench.synth_rows`, "NAME: synth.key=value,
..."; the recipe as is comes first as `recipe`), run as the user runs it (`eyas synth` in a child
process, the engine it starts, the recipe's turns and chunking) on the first `bench.synth_limit`
conversations of the recipe's training split, into a fresh dir per reading (the recipe's synth.max_seconds off,
so every row makes the same conversations). Every repeat runs every
row, the order rotating, so ratios to `recipe` are side by side on a noisy machine.

Per reading: generated tokens/s over the generation time (engine start apart, also printed), and the
FLOPs the target did for it (eyas.bench.roofline: each turn's new prompt tokens prefilled, each
generated token decoded at its context) against the measured matmul peak at the engine's dtype.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from eyas.bench.levers import parse_lever
from eyas.bench.roofline import peak_flops, target_flops
from eyas.config import Recipe, apply_override
from eyas.host import machine
from eyas.manifest import read_manifest
from eyas.target import text_config

RECIPE_ROW = "recipe"


def conversation_flops(tcfg: Any, prompt_tokens: list[int], completion_tokens: list[int]) -> tuple[float, float]:
    """(prefill FLOPs, decode FLOPs) the target spends on one conversation's turns. A turn of p prompt and
    c generated tokens prefills what its prompt adds to the cache (vLLM's prefix cache keeps the turns
    before: their prompt and every reply token but the last, which was never fed back), its logits
    giving the first token, then decodes c - 1 tokens; a token at position i attends to i + 1 keys."""
    per_tok = target_flops(tcfg, 0, False)
    head = target_flops(tcfg, 0, True) - per_tok
    attn = target_flops(tcfg, 1, False) - per_tok  # FLOPs per key attended
    pre = dec = 0.0
    held = 0
    for p, c in zip(prompt_tokens, completion_tokens):
        new = max(0, p - held)
        pre += new * per_tok + attn * (new * (p - new) + new * (new + 1) / 2) + head
        d = max(0, c - 1)
        dec += d * (per_tok + head) + attn * (d * p + d * (d + 1) / 2)
        held = p + d
    return pre, dec


def _row_yaml(cfg: Recipe, overrides: list[str], prompts: Path, out: Path, limit: int) -> Path:
    row = copy.deepcopy(cfg)
    row.synth.max_seconds = 0  # every row synthesizes the same conversations (a row may still set a budget)
    for ov in overrides:
        if not ov.startswith("synth."):
            raise ValueError(f"bench.synth_rows: {ov!r}: only synth.* settings change synthesis")
        apply_override(row, ov)
    s = dataclasses.asdict(row.synth)
    s.update(target=row.synth.target or row.run.target, prompts=str(prompts), out=str(out / "synth"), limit=limit)
    import yaml

    f = out.with_suffix(".yaml")
    f.write_text(yaml.safe_dump({"run": {"target": row.run.target, "out": str(out)}, "synth": s}))
    return f


def _reading(recipe_file: Path, out: Path, tcfg: Any, timeout: float) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    log = out.with_suffix(".log")
    t0 = time.monotonic()
    with open(log, "w") as lf:
        rc = subprocess.run([sys.executable, "-m", "eyas", "synth", "--recipe", str(recipe_file)], stdout=lf,
                            stderr=subprocess.STDOUT, timeout=timeout).returncode
    if rc != 0:
        raise RuntimeError(f"bench synth: eyas synth failed (exit {rc}); its log: {log}")
    m = read_manifest(out / "synth")
    lr = m["last_run"]
    pre = dec = 0.0
    with open(out / "synth" / "conversations.jsonl") as f:
        for line in f:
            meta = json.loads(line)["meta"]
            a, b = conversation_flops(tcfg, meta["prompt_tokens"], meta["completion_tokens"])
            pre, dec = pre + a, dec + b
    return {"wall_s": time.monotonic() - t0, "engine_start_s": lr["engine_start_s"], "generate_s": lr["generate_s"],
            "requests": lr["requests"], "completion_tokens": lr["completion_tokens"],
            "prompt_tokens": m["tokens"]["prompt"], "tokens_per_s": lr["completion_tokens"] / lr["generate_s"],
            "dtype": lr["dtype"], "prefill_flops": pre, "decode_flops": dec,
            "flops_per_s": (pre + dec) / lr["generate_s"]}


def bench_synth(cfg: Recipe, target: Path, prompts: Path, rows: list[str], out: Path, limit: int = 160,
                repeats: int = 2, timeout: float = 3600) -> dict[str, Any]:
    """{"rows": {NAME: medians, ratios to `recipe`, every reading}, "peak": {dtype: peak_flops}, ...}."""
    parsed = [(RECIPE_ROW, [])] + [parse_lever(r) for r in rows if parse_lever(r)[0] != RECIPE_ROW]
    names = [n for n, _ in parsed]
    if len(set(names)) != len(names):
        raise ValueError(f"bench.synth_rows: row names repeat: {names}")
    tcfg = text_config(target)
    out.mkdir(parents=True, exist_ok=True)
    files = {n: _row_yaml(cfg, ov, prompts, out / n, limit) for n, ov in parsed}
    cores = machine()["cores"]
    peaks = {dt: peak_flops(dt, cores) for dt in ("float32", "bfloat16")}  # before any engine runs: an idle machine
    readings: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(repeats):
        for n in names[r % len(names):] + names[:r % len(names)]:
            rd = _reading(files[n], out / n, tcfg, timeout)
            rd["fraction_of_peak"] = rd["flops_per_s"] / peaks[rd["dtype"] or "bfloat16"]["flops"]
            readings[n].append(rd)
            print(f"bench synth: repeat {r} {n:<10} {rd['tokens_per_s']:7.1f} generated tok/s "
                  f"({rd['completion_tokens']} tokens, {rd['requests']} requests, {rd['generate_s']:.1f} s + start "
                  f"{rd['engine_start_s']:.1f} s), {rd['flops_per_s'] / 1e9:.1f} GFLOP/s = "
                  f"{100 * rd['fraction_of_peak']:.1f}% of the {rd['dtype']} peak", flush=True)
    table: dict[str, Any] = {}
    for n, ov in parsed:
        rs = readings[n]
        table[n] = {"overrides": ov, "tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs),
                    "engine_start_s": statistics.median(x["engine_start_s"] for x in rs),
                    "fraction_of_peak": statistics.median(x["fraction_of_peak"] for x in rs),
                    "readings": rs}
    base = table[RECIPE_ROW]["tokens_per_s"]
    for row in table.values():
        row["ratio"] = row["tokens_per_s"] / base
    print(format_table(table, peaks))
    return {"rows": table, "peak": peaks, "conversations": limit, "repeats": repeats, "prompts": str(prompts)}


def format_table(table: dict[str, Any], peaks: dict[str, Any]) -> str:
    lines = ["| row | settings | generated tok/s (x recipe) | engine start s | share of matmul peak |", "|---|---|---|---|---|"]
    for n, row in table.items():
        lines.append(f"| {n} | {', '.join(row['overrides']) or '(the recipe)'} | {row['tokens_per_s']:.1f} "
                     f"({row['ratio']:.2f}x) | {row['engine_start_s']:.0f} | {100 * row['fraction_of_peak']:.1f}% |")
    lines.append("peak (torch.mm, measured before the rows): " + ", ".join(
        f"{dt} {p['flops'] / 1e9:.1f} GFLOP/s" for dt, p in peaks.items()))
    return "\n".join(lines)
