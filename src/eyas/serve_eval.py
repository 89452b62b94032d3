"""Stage 4 in the loop: after a checkpoint, the true acceptance length from vLLM.

`eyas train` (and `eyas run`) hand the trainer a checkpoint callback built here from the
recipe's `eval` section (`checkpoint_callback`): the trainer knows nothing of stage 4.
For each checkpoint it is given (rank 0), the callback exports it to
`RUN/serve_eval/step_N/draft` (validated), measures AL with vLLM speculative decoding in a
fresh process (the trainer's memory is untouched: the engine lives and dies in that
process) on the first `train.eval_limit` held-out prompts of `eval.prompts` with the
eval section's k, max_tokens and engine settings, appends a record to
`RUN/serve_eval.jsonl` and moves `RUN/checkpoints/best` (eyas.checkpoints) when the true
AL beats the best so far. So `eval.k` in a recipe decides which checkpoint wins.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from eyas.acceptance import load_prompts, measure_acceptance
from eyas.checkpoints import best_record, mark_best
from eyas.config import EvalConfig, RunConfig, TrainConfig
from eyas.export import export_checkpoint
from eyas.io import append_jsonl, atomic_write_text, scan_jsonl

LOG = "serve_eval.jsonl"


def read_records(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    return scan_jsonl(Path(run_dir) / LOG, "eyas serve-eval")


def on_checkpoint(run_dir: str | os.PathLike, ckpt_dir: str | os.PathLike, step: int, ev: EvalConfig,
                  prompts: list[dict[str, Any]], estimates: dict[str, Any] | None = None,
                  target: str = "") -> dict[str, Any]:
    """Export `ckpt_dir`, measure its true AL in vLLM with `ev`'s settings, log it, keep the best.

    A vLLM failure is recorded (with its log path) and returned with `error`, so training
    goes on; a draft that fails validation raises (the checkpoint itself is wrong).
    """
    run_dir, ckpt_dir = Path(run_dir), Path(ckpt_dir)
    out = run_dir / "serve_eval" / f"step_{step}"
    t0 = time.perf_counter()
    draft = export_checkpoint(ckpt_dir, out / "draft", target=target, k=ev.k)
    export_s = time.perf_counter() - t0
    served = json.loads((draft / "manifest.json").read_text())["target"]
    est = dict(estimates or {})
    est_al = est.pop("est_al", None)
    record: dict[str, Any] = {
        "step": int(step),
        "est_al": None if est_al is None else float(est_al),
        **est,  # sim_al, sim_per_pos: the simulated AL on the trainer's held-out features
        "checkpoint": str(ckpt_dir),
        "draft": str(draft),
        "export_seconds": export_s,
    }
    t1 = time.perf_counter()
    try:
        rep = measure_acceptance(
            served, draft, prompts, k=ev.k, max_tokens=ev.max_tokens, temperature=ev.temperature,
            max_model_len=ev.max_model_len, kv_cache_gib=ev.kv_cache_gib, by_domain=True, timeout=ev.timeout,
            log_path=out / "vllm.log", enforce_eager=ev.eager,
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
        k=ev.k,
        n_prompts=rep["n_prompts"],
        generated_tokens=rep["generated_tokens"],
        tokens_per_step=rep.get("tokens_per_step"),
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
        f"eyas serve-eval: step {step}: true AL {record['true_al']:.3f} (est {est_al}"
        + (f", simulated {record['sim_al']:.3f} on held-out features" if "sim_al" in record else "") + "), "
        f"per pos {[round(x, 3) for x in record['per_pos']]}, eval {record['eval_seconds']:.0f}s"
        + (" [best]" if record["best"] else ""),
        file=sys.stderr,
    )
    return record


def checkpoint_callback(run_dir: str | os.PathLike, ev: EvalConfig, limit: int, target: str = ""):
    """The trainer's `on_checkpoint` for `run_dir`, measuring with `ev` on the first `limit` prompts
    of `ev.prompts` (0: all); None (and a note) when `ev.prompts` is not set."""
    if not ev.prompts:
        print("eyas serve-eval: eval.prompts is not set; training without the vLLM acceptance check",
              file=sys.stderr)
        return None
    return Callback(run_dir, ev, load_prompts(ev.prompts, limit), target)  # a bad prompts file fails now


class Callback:
    """The trainer's checkpoint callback: `(ckpt_dir, step, estimates) -> record`; `measured(step)`
    tells a resumed trainer which due checkpoints still need their measurement."""

    def __init__(self, run_dir: str | os.PathLike, ev: EvalConfig, prompts: list[dict[str, Any]], target: str):
        self.run_dir, self.ev, self.prompts, self.target = run_dir, ev, prompts, target

    def __call__(self, ckpt_dir: Path, step: int, estimates: dict[str, Any]) -> dict[str, Any]:
        return on_checkpoint(self.run_dir, ckpt_dir, step, self.ev, self.prompts, estimates, self.target)

    def measured(self, step: int) -> bool:
        return any(r.get("step") == step and r.get("true_al") is not None for r in read_records(self.run_dir))


def train_with_serve_eval(t: TrainConfig, ev: EvalConfig) -> dict[str, Any]:
    """`eyas.train.train` with the checkpoint callback of `ev` (the trainer's target serves)."""
    from eyas.train import train

    return train(t, on_checkpoint=checkpoint_callback(t.out, ev, t.eval_limit, t.target))


def train_cli(t: TrainConfig, ev: EvalConfig, actions: list[str], run: RunConfig) -> int:
    """`eyas train [--flags]`: the train section, serve-evaluated with the eval section."""
    from eyas.train import print_summary

    if actions:
        raise ValueError(f"eyas train takes no actions, got {actions} (use --flags or train.key=value)")
    print_summary(train_with_serve_eval(t, ev))
    return 0


