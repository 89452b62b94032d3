"""`eyas run`: every stage end to end, each writing into `RUNDIR/<stage>` with its manifest.

    target ─▶ data mix ─▶ synth (vLLM) ─▶ extract ─▶ train (+ serve-eval in vLLM) ─▶ export ─▶ eval ─▶ bench

A stage that finds its complete output skips itself and a partial one resumes (training from its
last checkpoint, re-measuring a serve-eval that was cut off), so a killed run re-run with the same
command picks up where it stopped. A stage whose output was made with other settings or inputs
(a changed recipe) is set aside under `RUNDIR/superseded/` and run again; the stages after it
see changed inputs and follow, so the parts of a run dir always agree. The measurements (eval,
n-gram eval, throughput) are keyed by the served target, the draft's weights, the prompts and
their settings, and read back when nothing they depend on changed.

The run ends with `report.json`, `report.md`, plots and the exact `vllm serve` command for the
exported draft.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from eyas.config import Recipe, to_dict
from eyas.data import build_mix
from eyas.evaluate import evaluate
from eyas.export import export_run, serve_command
from eyas.host import machine
from eyas.hybrid_serve import parse_lookup, policy_of, policy_spec, with_policy
from eyas.vllm_runner import SUFFIX, suffix_available
from eyas.io import atomic_write_text
from eyas.lock import held_env, writing
from eyas.manifest import read_manifest, sha256_file, write_manifest
from eyas.models import resolve_target
from eyas.report import write_report
from eyas.stage import ChangedOutput, claim, output_dir, set_aside
from eyas.target import target_fingerprint


@contextlib.contextmanager
def _stage(timings: dict[str, float], name: str):
    """Time one stage into `timings[name]` and print its banner."""
    t0 = time.perf_counter()
    print(f"\n=== eyas run: {name} ===", flush=True)
    yield
    timings[name] = round(time.perf_counter() - t0, 1)
    print(f"=== {name}: {timings[name]:.0f} s ===", flush=True)


def again_if_changed(out: Path, call):
    """`call()`; when a stage refuses its dir inside the run dir `out` for other settings, set that
    dir aside (moved, not deleted) and call again."""
    try:
        return call()
    except ChangedOutput as e:
        if not e.dir.resolve().is_relative_to(out) or e.dir.resolve() == out:
            raise
        print(f"eyas run: {e}\neyas run: the recipe changed it: moved to {set_aside(e.dir.resolve(), out)}; "
              "running the stage again", flush=True)
        return call()


def _once(path: Path, key: dict[str, Any], measure, pick: str = "") -> Any:
    """A measurement `eyas run` takes once per `key`: read back from `path` when the file holds this key
    (a re-run after a kill, or of a finished run), else taken (`measure()` writes `path`) and keyed."""
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except ValueError:
            old = {}
        if isinstance(old, dict) and old.get("key") == key:
            print(f"eyas run: {path.name} holds this measurement already (same target, draft, prompts, "
                  "settings); read back", flush=True)
            old.pop("key")
            return old[pick] if pick else old
    got = measure()
    data = json.loads(path.read_text())
    atomic_write_text(path, json.dumps({**data, "key": key}, indent=2) + "\n")
    return got


def _prompts(cfg: Recipe, out: Path) -> tuple[Path, Path]:
    """(training prompts, held-out prompts): the recipe's own files (`synth.prompts`, `eval.prompts`) where
    it names them, else the shipped sources' mix (`data.*`) into RUNDIR/data."""
    d = cfg.data
    own_train, own_eval = cfg.synth.prompts, cfg.eval.prompts
    if own_train and own_eval:
        print("eyas run: synth.prompts and eval.prompts are the recipe's own: no data mix", flush=True)
        return Path(own_train), Path(own_eval)
    if not d.sources:
        raise ValueError("data.sources is empty: name shipped sources to mix, or give your own prompts as "
                         "synth.prompts=TRAIN.jsonl and eval.prompts=HELD_OUT.jsonl")
    paths = build_mix(d.sources, d.max_per_source, d.seed, out / "data", d.eval_fraction)
    return Path(own_train) if own_train else paths["train"], Path(own_eval) if own_eval else paths["eval"]


def _train(cfg: Recipe, nproc: int) -> None:
    """Train in-process (1 rank) or under torchrun (N ranks) with the same train and eval sections."""
    if nproc <= 1:
        from eyas.serve_eval import train_with_serve_eval

        train_with_serve_eval(cfg.train, cfg.eval)
        return
    from eyas.train import resolve_lengths, resume_point

    overrides = [f"{sec}.{k}={json.dumps(v) if isinstance(v, list) else v}"
                 for sec in ("train", "eval") for k, v in to_dict(getattr(cfg, sec)).items()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "eyas", "train", *overrides]
    with writing(cfg.train.out, "eyas train"):  # held here; the ranks write inside it (EYAS_HELD_LOCKS)
        resume_point(resolve_lengths(cfg.train))  # a changed run dir is refused here, where `eyas run` can set it aside
        rc = subprocess.run(cmd, env=held_env()).returncode
    if rc != 0:
        raise ValueError(f"the {nproc} training ranks stopped with exit {rc} (their error is above); "
                         "re-run the same command to resume from the last checkpoint")


def _training_minutes(cfg: Recipe, elapsed_s: float) -> float:
    """run.max_minutes: the training budget left once the stages before it took `elapsed_s`, printed."""
    from eyas.train.budget import MIN_TRAIN_MINUTES, minutes_for_training

    r = cfg.run
    got = minutes_for_training(r.max_minutes, r.reserve_minutes, elapsed_s, cfg.train.max_minutes)
    own = f"train.max_minutes {cfg.train.max_minutes:g}" if cfg.train.max_minutes > 0 else "no train.max_minutes"
    late = r.max_minutes - r.reserve_minutes - elapsed_s / 60 < MIN_TRAIN_MINUTES
    print(f"eyas run: run.max_minutes {r.max_minutes:g}: {elapsed_s / 60:.1f} gone, {r.reserve_minutes:g} kept for "
          f"export, eval and bench: training gets {got:.1f} min ({own})"
          + ("; too little is left: training times its first steps (train.max_minutes), then ends"
             if late else ""), flush=True)
    return got


def _slug(spec: str) -> str:
    return "hybrid_" + spec.replace(":", "_").replace(">=", "ge").replace(">", "_over_")


def _picked_lookup(out: Path) -> str:
    """The policy an earlier `export.lookup: auto` exported into this run dir (none before the first pick)."""
    p = out / "lookup.json"
    return str(json.loads(p.read_text()).get("exported") or "none") if p.exists() else "none"


def _pick(alone: dict[str, Any], hybrids: dict[str, dict[str, Any]], auto: bool) -> dict[str, Any]:
    """Tokens per target step of the draft alone and with each lookup policy on the same prompts, and the one
    exported: the best hybrid where it beats the draft alone (auto), else none."""
    tps = {spec: r.get("tokens_per_step") or 0.0 for spec, r in hybrids.items()}
    best = max(tps, key=lambda s: tps[s])
    base = alone.get("tokens_per_step") or 0.0
    won = tps[best] > base
    return {"draft_alone": base, "candidates": tps, "best": best, "gain": tps[best] / base - 1 if base else None,
            "exported": (best if won else "none") if auto else best,
            "sources": {spec: r.get("hybrid") for spec, r in hybrids.items()},
            "domains": {spec: {d: v.get("tokens_per_step") for d, v in (r.get("domains") or {}).items()}
                        for spec, r in hybrids.items()}}


def run(cfg: Recipe) -> dict[str, Any]:
    """Every stage into the run dir `cfg.run.out`, held by this process alone (`eyas.lock`) throughout."""
    out = output_dir(cfg.run.out, "--out").resolve()
    with writing(out, "eyas run"):
        return _run(copy.deepcopy(cfg), out)


def _run(cfg: Recipe, out: Path) -> dict[str, Any]:
    key = to_dict(cfg)  # the recipe as given; each stage claims its own subdir with its own key
    key["run"].pop("plan", None)  # how it was asked for, not what it makes
    claim(out, "run", key, on_change="replace")  # a new dir or a run dir: never a foreign folder
    write_manifest(out, "run", cfg, key=key, complete=False)
    timings: dict[str, float] = {}
    report: dict[str, Any] = {"name": out.name, "config": to_dict(cfg)}
    t_start = time.monotonic()  # run.max_minutes counts from here

    with _stage(timings, "target"):
        target = resolve_target(cfg.run.target)
        serve_target = quark_target = target
        if cfg.run.quantized_target:
            from eyas.quant import quantize_model

            cfg.quantize.model, cfg.quantize.out, cfg.quantize.emulate = str(target), str(out / "target_mxfp4"), True
            q = quantize_model(cfg.quantize)
            serve_target, quark_target = Path(q["emulated"]), Path(q["out"])
        report["target"] = str(target)
        report["served_target"] = str(serve_target)
        report["machine"] = machine()

    with _stage(timings, "data"):
        train_prompts, eval_prompts = _prompts(cfg, out)

    with _stage(timings, "synth"):
        from eyas.synth import synthesize

        s = cfg.synth
        s.target, s.prompts, s.out = str(serve_target), str(train_prompts), str(out / "synth")
        # states captured while the target writes serve the offline features only (online/streaming run it again)
        s.capture = s.capture and cfg.train.source == "offline"
        s.capture_layer_ids = s.capture_layer_ids or list(cfg.extract.layer_ids)
        conversations = Path(again_if_changed(out, lambda: synthesize(s))) / "conversations.jsonl"

    with _stage(timings, "extract"):
        e = cfg.extract
        e.target, e.data, e.out = str(serve_target), str(conversations), str(out / "features")
        if cfg.train.source == "offline":
            from eyas.extract import extract

            again_if_changed(out, lambda: extract(e))

    with _stage(timings, "train"):
        t = cfg.train
        if t.source == "streaming":
            raise ValueError("eyas run trains offline or online (train.source); streaming needs its producers started "
                             "apart (`eyas extract --mode streaming`) and `eyas train` itself")
        # offline: the features extracted above; online: the conversations, extracted inside training
        t.features = str(out / "features") if t.source == "offline" else str(conversations)
        t.target, t.out = str(serve_target), str(out / "train")
        t.resume = True  # the run dir's own training: a killed run continues from its last checkpoint
        t.eval_lone_final = False  # the eval stage below measures the last checkpoint on every held-out prompt
        if cfg.run.max_minutes > 0:
            t.max_minutes = _training_minutes(cfg, time.monotonic() - t_start)
        cfg.eval.target, cfg.eval.prompts = str(serve_target), str(eval_prompts)  # serve-eval measures with eval.*
        again_if_changed(out, lambda: _train(cfg, cfg.run.nproc))

    with _stage(timings, "export"):
        x = cfg.export
        x.run, x.out, x.target = str(out / "train"), str(out / "draft"), str(serve_target)
        auto = x.lookup == "auto"
        if auto:  # an earlier run's pick, re-checked below against this draft's weights
            x.lookup = _picked_lookup(out)
        draft = Path(export_run(x, cfg.eval.k))

    # what a measurement depends on: the served target, the draft's weights, the prompts
    measured = {"target": target_fingerprint(serve_target), "draft": read_manifest(draft)["weights_sha256"],
                "prompts": sha256_file(eval_prompts)}

    with _stage(timings, "eval"):
        v = cfg.eval
        policy = policy_of(json.loads((draft / "config.json").read_text()))
        # the draft alone (its exported lookup policy, if any, stripped in a served copy of links)
        v.draft, v.out = str(with_policy(draft, None) if policy else draft), str(out / "eval.json")
        how = {**to_dict(v), "draft": "draft"}  # keyed by the weights, not by where they are served from
        report["eval"] = _once(out / "eval.json", {**measured, "eval": how}, lambda: evaluate(v))
        if v.ngram:  # prompt lookup on the same prompts: tokens per target step, side by side in the report
            vn = dataclasses.replace(v, draft="ngram", out=str(out / "eval_ngram.json"))
            report["eval_ngram"] = _once(out / "eval_ngram.json", {**measured, "draft": "ngram", "eval": to_dict(vn)},
                                         lambda: evaluate(vn))
            why = suffix_available() if v.suffix else "eval.suffix is off"
            if why:
                print(f"eyas run: suffix decoding not measured: {why}", flush=True)
            else:  # Arctic Inference's suffix trees (vLLM method "suffix"), the other no-training proposer
                vs = dataclasses.replace(v, draft=SUFFIX, out=str(out / "eval_suffix.json"))
                report["eval_suffix"] = _once(out / "eval_suffix.json",
                                              {**measured, "draft": SUFFIX, "eval": to_dict(vs)}, lambda: evaluate(vs))
        cands = list(dict.fromkeys(x.lookup_candidates if auto else ([policy_spec(policy)] if policy else [])))
        if auto and suffix_available():  # suffix candidates need arctic-inference
            print(f"eyas run: suffix lookup candidates skipped: {suffix_available()}", flush=True)
            cands = [c for c in cands if not c.startswith(SUFFIX)]
        hybrids = {}
        for spec in cands:  # the draft with prompt lookup beside it (eyas.hybrid_serve), one policy each
            pol = parse_lookup(spec, v.k)
            vh = dataclasses.replace(v, draft=str(with_policy(draft, pol)), out=str(out / f"eval_{_slug(spec)}.json"))
            hybrids[spec] = _once(Path(vh.out), {**measured, "lookup": pol, "eval": how}, lambda vh=vh: evaluate(vh))
        if hybrids:
            report["lookup"] = _pick(report["eval"], hybrids, auto)
        if auto:
            if report["lookup"]["exported"] != x.lookup:  # export again with the winner (the same weights)
                x.lookup = report["lookup"]["exported"]
                draft = Path(export_run(x, cfg.eval.k))
            atomic_write_text(out / "lookup.json", json.dumps(report["lookup"], indent=2) + "\n")

    with _stage(timings, "bench"):
        from eyas.bench.acceptance import domain_prompts
        from eyas.bench.throughput import bench_throughput

        b = cfg.bench
        if not b.concurrency:
            print("eyas run: bench.concurrency is empty: no throughput bench", flush=True)
        else:
            prompts = [r["messages"] for r in domain_prompts(eval_prompts, b.limit)]
            report["throughput"] = _once(
                out / "throughput.json", {**measured, "bench": to_dict(b), "k": cfg.eval.k},
                lambda: bench_throughput(serve_target, draft, prompts, b.concurrency, b.max_tokens, cfg.eval.k,
                                         out=out / "throughput.json", baselines=tuple(b.baselines)), pick="rows")

    from eyas.serve_eval import read_records

    report["serve_eval"] = read_records(out / "train")
    report["train"] = (read_manifest(out / "train") or {}).get("final")  # steps, tokens, a train.max_minutes fit
    report["timings"] = timings
    report["serve_command"] = serve_command(quark_target, draft, cfg.eval.k, quantized=cfg.run.quantized_target,
                                            emulated=serve_target)
    paths_out = write_report(out, report)
    write_manifest(out, "run", cfg, key=key, complete=True, timings=timings, report=str(paths_out["json"]))
    ng, lk = report.get("eval_ngram") or {}, report.get("lookup") or {}
    exported = lk.get("exported", "none")
    print(f"\neyas run: acceptance length {report['eval'].get('acceptance_length', float('nan')):.3f} "
          f"(k={cfg.eval.k})" + (f"; tokens per target step {report['eval'].get('tokens_per_step') or 0:.3f} against "
                                 f"n-gram lookup's {ng.get('tokens_per_step') or 0:.3f}" if ng else "")
          + (f"; with prompt lookup beside it ({exported}, exported) {lk['candidates'][exported]:.3f}"
             if exported != "none" else "") + f"; report {paths_out['md']}")
    print("serve it with:\n  " + report["serve_command"])
    return report


def cli(cfg: Recipe, actions: list[str]) -> int:
    if actions:
        raise ValueError(f"`eyas run` takes no actions (got {actions}); use --recipe, --out and section.key=value")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if cfg.run.plan:
        from eyas.plan import print_plan

        print_plan(cfg)
        return 0
    run(cfg)
    return 0
