"""Stage 4 in the loop: after each checkpoint, the true acceptance length from vLLM.

The trainer (rank 0 only) calls `on_checkpoint` after saving a checkpoint. It exports
the checkpoint to `RUN/serve_eval/step_N/draft` (validated), measures AL with vLLM
speculative decoding in a fresh process (the trainer's memory is untouched: the engine
lives and dies in that process) on the held-out prompts, appends a record to
`RUN/serve_eval.jsonl` and keeps the best checkpoint by true AL as `RUN/checkpoints/best`
(a relative symlink, plus `best.json` with its record). What it costs is in the record.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from eyas.data.store import append_jsonl
from eyas.manifest import atomic_write_text

LOG = "serve_eval.jsonl"


def read_records(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    p = Path(run_dir) / LOG
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def best_record(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    p = Path(run_dir) / "checkpoints" / "best.json"
    return json.loads(p.read_text()) if p.exists() else None


def mark_best(run_dir: Path, ckpt_dir: Path, record: dict[str, Any]) -> None:
    """Point `checkpoints/best` at `ckpt_dir` (relative symlink, replaced atomically) and write best.json."""
    ck = run_dir / "checkpoints"
    ck.mkdir(parents=True, exist_ok=True)
    link = ck / "best"
    if link.exists() and not link.is_symlink():
        raise RuntimeError(f"{link} exists and is not a symlink; refusing to replace it")
    rel = os.path.relpath(ckpt_dir.resolve(), ck.resolve())
    tmp = ck / f".best.tmp.{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(rel, tmp)
    os.replace(tmp, link)
    atomic_write_text(ck / "best.json", json.dumps({**record, "checkpoint": rel}, indent=2) + "\n")


def on_checkpoint(
    run_dir: str | os.PathLike,
    ckpt_dir: str | os.PathLike,
    step: int,
    train_cfg,
    est_al: float | None = None,
    k: int = 3,
    max_tokens: int = 64,
    kv_cache_gib: float = 1.0,
    max_model_len: int = 2048,
    timeout: float = 1800,
) -> dict[str, Any] | None:
    """Export `ckpt_dir`, measure its true AL in vLLM, log it, keep the best. Returns the record.

    None when there are no held-out prompts (train.eval_prompts unset). A vLLM failure is
    recorded (with its log path) and returned with `error`, so training goes on; a draft
    that fails validation raises (the checkpoint itself is wrong).
    """
    from eyas.evaluate import load_prompts, measure_acceptance
    from eyas.export import export_checkpoint

    run_dir, ckpt_dir = Path(run_dir), Path(ckpt_dir)
    if not getattr(train_cfg, "eval_prompts", ""):
        print("eyas serve-eval: train.eval_prompts is not set; skipping the vLLM acceptance check", file=sys.stderr)
        return None
    out = run_dir / "serve_eval" / f"step_{step}"
    t0 = time.perf_counter()
    draft = export_checkpoint(ckpt_dir, out / "draft", target=getattr(train_cfg, "target", ""), k=k)
    export_s = time.perf_counter() - t0
    target = json.loads((draft / "manifest.json").read_text())["target"]
    prompts = load_prompts(train_cfg.eval_prompts, getattr(train_cfg, "eval_limit", 0))
    record: dict[str, Any] = {
        "step": int(step),
        "est_al": None if est_al is None else float(est_al),
        "checkpoint": str(ckpt_dir),
        "draft": str(draft),
        "export_seconds": export_s,
    }
    t1 = time.perf_counter()
    try:
        rep = measure_acceptance(
            target, draft, prompts, k=k, max_tokens=max_tokens, kv_cache_gib=kv_cache_gib,
            max_model_len=max_model_len, by_domain=True, timeout=timeout, log_path=out / "vllm.log",
        )
    except RuntimeError as e:
        record.update(true_al=None, eval_seconds=time.perf_counter() - t1, error=str(e)[-2000:],
                      log=str(out / "vllm.log"))
        append_jsonl(run_dir / LOG, [record])
        print(f"eyas serve-eval: step {step}: vLLM failed (see {out / 'vllm.log'})\n{traceback.format_exc()}",
              file=sys.stderr)
        return record
    record.update(
        true_al=rep["acceptance_length"],
        acceptance_length=rep["acceptance_length"],  # the name the trainer logs to TensorBoard
        eval_seconds=time.perf_counter() - t1,
        engine_load_seconds=rep["load_seconds"],
        per_pos=rep["per_pos"],
        al_at_k=rep["al_at_k"],
        k=k,
        n_prompts=rep["n_prompts"],
        generated_tokens=rep["generated_tokens"],
        tokens_per_s=rep["tokens_per_s"],
        domains={d: v["acceptance_length"] for d, v in rep["domains"].items()},
    )
    atomic_write_text(out / "eval.json", json.dumps(rep, indent=2) + "\n")
    best = best_record(run_dir)
    record["best"] = best is None or best.get("true_al") is None or record["true_al"] > best["true_al"]
    if record["best"]:
        mark_best(run_dir, ckpt_dir, record)
    append_jsonl(run_dir / LOG, [record])
    print(
        f"eyas serve-eval: step {step}: true AL {record['true_al']:.3f} (est {est_al}), "
        f"per pos {[round(x, 3) for x in record['per_pos']]}, eval {record['eval_seconds']:.0f}s"
        + (" [best]" if record["best"] else ""),
        file=sys.stderr,
    )
    return record
