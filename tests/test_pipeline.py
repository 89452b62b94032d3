"""`eyas run` killed with -9 at seeded points and re-run with the same command finishes with every
stage's output once and the training identical to an uninterrupted run; a changed recipe sets the
stage it changes, and every stage after it, aside and runs them again.

One tiny run end to end with vLLM (a random 128-wide llama; synthesis, serve-eval and eval start
engines), the HF backend for extraction, no throughput bench."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from eyas.io import scan_jsonl

pytestmark = pytest.mark.slow


def _recipe(target: Path, out: Path, max_tokens: int = 12) -> dict:
    return {
        "run": {"target": str(target), "out": str(out)},
        "data": {"sources": ["humaneval"], "max_per_source": 14, "eval_fraction": 0.2, "seed": 0},
        "synth": {"max_tokens": max_tokens, "concurrency": 4, "max_model_len": 768, "kv_cache_gib": 1},
        "extract": {"backend": "hf", "compute_dtype": "fp32"},
        "train": {"max_steps": 8, "ttt_steps": 2, "draft_vocab_size": 512, "lr": 2e-3, "warmup_steps": 2,
                  "token_budget": 512, "save_every": 2, "eval_every": 4, "eval_limit": 2, "loss_tokens": "all",
                  "threads": 1, "precision": "fp32", "progress": False, "log_every": 1},
        "eval": {"k": 2, "max_tokens": 8, "limit": 2, "ngram": False, "kv_cache_gib": 1, "max_model_len": 768},
        "export": {"dtype": "bf16"},
        "bench": {"concurrency": []},
    }


def _start(recipe: Path, log: Path, **env: str) -> subprocess.Popen:
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, "-m", "eyas", "run", "--recipe", str(recipe)],
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **env})


def _two_at_once(recipe: Path, log: Path, gate: Path) -> subprocess.Popen:
    """Two `eyas run` on one run dir, started together, each held at its first write (inside the run's
    lock) until one has ended: the other is refused at once with one line naming the holder. The one
    that goes on is returned."""
    env = {"EYAS_FAILPOINTS": "write.before_rename:1:gate", "EYAS_FAILPOINT_GATE": str(gate)}
    logs = [log.with_suffix(f".{i}.log") for i in (0, 1)]
    procs = [_start(recipe, lg, **env) for lg in logs]
    t0 = time.monotonic()
    while all(p.poll() is None for p in procs):
        assert time.monotonic() - t0 < 300, "neither eyas run ended while the gate was shut"
        time.sleep(0.1)
    gate.write_text("open")
    refused = next(i for i, p in enumerate(procs) if p.poll() is not None)
    text = logs[refused].read_text()
    assert procs[refused].returncode == 2, text[-3000:]
    held = procs[1 - refused]
    assert text.strip().splitlines()[-1].startswith(f"eyas run: error: {recipe.parent / 'run'} is being written by "
                                                    f"pid {held.pid}: eyas run --recipe"), text[-3000:]
    with open(log, "ab") as f:
        f.write(logs[1 - refused].read_bytes())
    return held


def _kill_when(p: subprocess.Popen, ready, delay: float, what: str, timeout: float = 600) -> None:
    """kill -9 the `eyas run` process alone (as a user would) `delay` s after `ready()` turns true."""
    t0 = time.monotonic()
    while not ready():
        assert p.poll() is None, f"eyas run ended before {what}"
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.05)
    time.sleep(delay)
    assert p.poll() is None, f"eyas run ended before the kill {what}"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    time.sleep(3)  # its watchdog takes the engines down


def _finish(recipe: Path, log: Path) -> str:
    p = _start(recipe, log)
    assert p.wait(timeout=900) == 0, log.read_text()[-4000:]
    return log.read_text()


def test_run_resumes_after_kill9_and_reruns_what_a_recipe_change_touches(vllm_target, tmp_path):
    from safetensors.torch import load_file

    from eyas.config import TrainConfig
    from eyas.train import train

    out = tmp_path / "run"
    recipe, log = tmp_path / "tiny.yaml", tmp_path / "run.log"
    recipe.write_text(yaml.safe_dump(_recipe(vllm_target, out)))
    rng = random.Random(0)  # seeded points inside each window

    # 1) started twice at once: one is refused, the other goes on and is killed mid-training, right after
    # checkpoint step_2 (steps 3-4 and the step-4 serve-eval to come)
    p = _two_at_once(recipe, log, tmp_path / "gate")
    _kill_when(p, lambda: (out / "train/checkpoints/step_2/trainer.json").exists(), rng.uniform(0, 0.3),
               "checkpoint step_2")
    # 2) re-run, killed during the step-4 serve-eval (its draft exported, vLLM measuring)
    p = _start(recipe, log)
    _kill_when(p, lambda: (out / "train/serve_eval/step_4/draft/manifest.json").exists(), rng.uniform(0.5, 3),
               "the step-4 serve-eval")
    assert not any(r["step"] == 4 for r in scan_jsonl(out / "train/serve_eval.jsonl")), "the kill landed too late"
    # 3) the same command again: finishes
    n = log.read_text().count("=== eyas run: target ===")
    text = _finish(recipe, log).split("=== eyas run: target ===")[n + 1]
    assert "step_4 was due for evaluation and has no record" in text
    assert "resumed from" in text and "step_4" in text

    se = scan_jsonl(out / "train/serve_eval.jsonl")
    assert [r["step"] for r in se] == [4, 8] and all(r["true_al"] >= 1.0 for r in se)
    losses = [r["step"] for r in scan_jsonl(out / "train/metrics.jsonl") if "loss" in r]
    assert losses == list(range(1, 9))  # every step logged once
    report = json.loads((out / "report.json").read_text())
    assert report["eval"]["acceptance_length"] >= 1.0
    assert json.loads((out / "manifest.json").read_text())["complete"]

    # the killed-and-resumed training equals one uninterrupted run of the same settings
    cfg = json.loads((out / "train/manifest.json").read_text())["config"]
    ref = tmp_path / "ref"
    train(TrainConfig(**{**cfg, "out": str(ref), "resume": False}))
    a = load_file(out / "train/checkpoints/step_8/draft.safetensors")
    b = load_file(ref / "checkpoints/step_8/draft.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)

    # a finished run re-run: every stage has nothing to do, the eval is read back, not measured again
    n = log.read_text().count("=== eyas run: target ===")
    text = _finish(recipe, log).split("=== eyas run: target ===")[n + 1]
    assert text.count("nothing to do") >= 4 and "moved to" not in text, text[-3000:]
    assert "eval.json holds this measurement already" in text and "eyas eval: " not in text

    # a changed synthesis: synth, features and train are set aside (not deleted) and made again
    exported = json.loads((out / "draft/manifest.json").read_text())["key"]["checkpoint_sha256"]
    recipe.write_text(yaml.safe_dump(_recipe(vllm_target, out, max_tokens=10)))
    n = log.read_text().count("=== eyas run: target ===")
    text = _finish(recipe, log).split("=== eyas run: target ===")[n + 1]
    assert text.count("moved to") == 3 and "eval.json holds" not in text, text[-3000:]
    aside = sorted(p.relative_to(out).parts[2] for p in (out / "superseded").glob("*/*"))
    assert aside == ["features", "synth", "train"], aside
    assert (next((out / "superseded").glob("*/train")) / "checkpoints/step_8/draft.safetensors").exists()
    assert json.loads((out / "synth/manifest.json").read_text())["config"]["max_tokens"] == 10
    assert [r["step"] for r in scan_jsonl(out / "train/serve_eval.jsonl")] == [4, 8]
    assert json.loads((out / "draft/manifest.json").read_text())["key"]["checkpoint_sha256"] != exported
