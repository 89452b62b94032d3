"""`eyas run --plan`: what a run would do in its run dir and what it would make, with nothing started.

Each stage's line says what it will do there (to do / resumes / done: skipped / other settings: set
aside and made again), read from the manifests in the run dir, and the sizes it will produce, each
with how it is estimated: exact where an earlier stage's output is there to count, an upper bound
from the recipe where it is not. Nothing is fetched, written or started; the target's shape is read
when it is already on disk.
"""

from __future__ import annotations

from pathlib import Path

from eyas.config import Recipe
from eyas.io import iter_jsonl
from eyas.manifest import read_manifest
from eyas.models import REGISTRY, model_dir
from eyas.synth import KEY_FIELDS as SYNTH_KEY
from eyas.synth import finished as synth_finished

BYTES = {"bf16": 2, "fp8": 1}


def _n(x: float) -> str:
    return f"{x:,.0f}"


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def _target_shape(target: str) -> dict[str, int] | None:
    """(hidden size, layers) of a target already on disk, else None."""
    d = model_dir(target) if target in REGISTRY else Path(target).expanduser()
    if not (d / "config.json").exists():
        return None
    from eyas.target import facts

    return facts(d)


def _state(d: Path, differs: list[str]) -> str:
    man = read_manifest(d) if d.is_dir() else None
    if man is None:
        return "to do"
    if differs:
        return f"made with other settings ({', '.join(differs)}): set aside under superseded/ and made again"
    return "done: skipped" if man.get("complete") else "partial: resumes"


def _data(cfg: Recipe, out: Path) -> tuple[str, list[dict] | None]:
    d = cfg.data
    if cfg.synth.prompts and Path(cfg.synth.prompts).is_file():
        recs = [r for _, r in iter_jsonl(cfg.synth.prompts)]
        return f"the recipe's own prompts: {cfg.synth.prompts}, {_n(len(recs))} rows (counted)", recs
    train = out / "data" / "train.jsonl"
    man = read_manifest(out / "data")
    if man and man.get("complete") and train.exists():
        recs = [r for _, r in iter_jsonl(train)]
        return f"done: skipped; {_n(len(recs))} train / {_n(man.get('eval', 0))} held-out prompts (counted)", recs
    cap = d.max_per_source or "all"
    return (f"to do: {len(d.sources)} sources ({', '.join(d.sources)}) x at most {cap} prompts each, "
            f"{d.eval_fraction:.0%} held out (upper bound: the cap; a source may hold fewer)"), None


def plan(cfg: Recipe) -> list[tuple[str, str]]:
    """(stage, what it will do and make) for the run dir `cfg.run.out`."""
    out = Path(cfg.run.out).expanduser()
    rows: list[tuple[str, str]] = []
    shape = _target_shape(cfg.run.target)
    missing = "to fetch and convert" if cfg.run.target in REGISTRY else "no HF model dir there (config.json): the run stops"
    rows.append(("target", f"{cfg.run.target}: " + (f"on disk (hidden {shape['hidden_size']}, {shape['num_layers']} "
                                                     "layers)" if shape else missing)
                 + ("; quantized to MXFP4 first (run.quantized_target)" if cfg.run.quantized_target else "")))
    line, recs = _data(cfg, out)
    rows.append(("data", line))

    s = cfg.synth
    sman = read_manifest(out / "synth") or {}
    differs = [k for k in SYNTH_KEY if k in (sman.get("key") or {}) and sman["key"][k] != getattr(s, k)]
    turns = sum(sum(m["role"] == "user" for m in r["messages"]) if s.turns == "regenerate" else 1 for r in recs) \
        if recs is not None else None
    if turns is not None:
        size = f"{_n(len(recs))} conversations, {_n(turns)} replies x <= {s.max_tokens} new tokens = <= {_n(turns * s.max_tokens)} generated tokens (counted from the prompts)"
    else:
        cap = cfg.data.max_per_source * len(cfg.data.sources)
        size = (f"<= {_n(cap)} conversations; >= one reply each of <= {s.max_tokens} new tokens (the prompts are not "
                "there yet to count their user turns)") if cap else "the prompts are not there yet to count"
    done = sman.get("counts") or {}
    state = _state(out / "synth", differs)
    if state == "done: skipped" and not synth_finished(sman, s):
        state = (f"partial: resumes (its {sman['budget']['max_seconds']:g} s budget was spent; this recipe's "
                 f"synth.max_seconds is {s.max_seconds:g})")
    elif state == "done: skipped" and (sman.get("budget") or {}).get("spent"):
        state = f"done: skipped (stopped by its synth.max_seconds={s.max_seconds:g})"
    if s.max_seconds and not state.startswith("done"):
        size += f"; stops starting conversations after {s.max_seconds:g} s of generation (synth.max_seconds)"
    rows.append(("synth", f"{state}; {size}"
                 + (f"; there now: {_n(done.get('ok', 0))} done, {_n(done.get('pending', 0))} pending, "
                    f"{_n((sman.get('tokens') or {}).get('completion', 0))} tokens" if done else "")))

    e, t = cfg.extract, cfg.train
    max_len = e.max_len or s.max_model_len
    per_token = (len(e.layer_ids) or 3) + 1
    if t.source != "offline":
        rows.append(("extract", f"none on disk: train.source={t.source} extracts inside training"))
    else:
        fman = read_manifest(out / "features") or {}
        differs = [k for k in ("dtype", "max_len") if k in fman and fman[k] != {"dtype": e.dtype, "max_len": max_len}[k]]
        synth_done = synth_finished(sman, s)
        if synth_done:
            toks = (sman.get("tokens") or {})
            n = toks.get("prompt", 0) + toks.get("completion", 0)
            how = f"~{_n(n)} tokens (the synthesis' prompt + completion tokens; each conversation cut at {max_len})"
        else:
            convs = len(recs) if recs is not None else cfg.data.max_per_source * len(cfg.data.sources)
            n = convs * max_len
            how = f"<= {_n(n)} tokens ({'' if recs is not None else '<= '}{_n(convs)} conversations x max_len {max_len})"
        size = (f"{how}; x {per_token} states x hidden {shape['hidden_size']} x {BYTES[e.dtype]} bytes = "
                f"{'~' if synth_done else '<= '}{_gb(n * per_token * shape['hidden_size'] * BYTES[e.dtype])}"
                if shape and n else how + " (x the target's hidden size, not on disk yet)")
        if s.capture:
            size += ("; the states synthesis captured (synth.capture; a bf16 copy in synth/captured) are taken as "
                     "they are: the target runs only the conversations not captured")
        rows.append(("extract", f"{_state(out / 'features', differs)}; {e.backend} backend, {e.dtype}; {size}"
                     + (f"; there now: {_n(fman.get('num_samples', 0))} samples" if fman else "")))

    from eyas.checkpoints import latest_checkpoint
    from eyas.train.budget import resumed_max_steps

    seen = t.max_steps * t.token_budget * t.grad_accum * max(1, cfg.run.nproc)
    ck = latest_checkpoint(out / "train") if (out / "train").is_dir() else None
    tman = (read_manifest(out / "train") or {}) if ck is not None else {}
    last = resumed_max_steps(t.max_steps, t.max_minutes, tman)
    state = "to do" if ck is None else (
        "done: skipped" if tman.get("complete") and ck.name == f"step_{last}" else f"resumes from {ck.name}")
    budget = (f"; at most train.max_minutes {t.max_minutes:g} of steps: fewer steps where they do not fit, timed on "
              "this machine" if t.max_minutes > 0 else "")
    if cfg.run.max_minutes > 0:
        budget += (f"; at most what is left of run.max_minutes {cfg.run.max_minutes:g} when it starts, less "
                   f"run.reserve_minutes {cfg.run.reserve_minutes:g} for export, eval and bench")
    rows.append(("train", f"{state}; {t.max_steps} steps x {t.token_budget} tokens x grad_accum {t.grad_accum} x "
                 f"{max(1, cfg.run.nproc)} rank(s) = {_n(seen)} tokens seen (packed micro-batches: an upper bound); "
                 f"serve-eval every {t.eval_every or t.max_steps} steps{budget}"))
    rows.append(("export", f"{_state(out / 'draft', [])}; {cfg.export.dtype} draft of the best checkpoint"))
    ev = cfg.eval
    rows.append(("eval", ("measured: read back when nothing it depends on changed" if (out / "eval.json").exists()
                          else "to do") + f"; held-out prompts{f' (<= {ev.limit})' if ev.limit else ''} x "
                 f"{ev.max_tokens} new tokens, k={ev.k}" + ("; n-gram lookup beside it" if ev.ngram else "")))
    b = cfg.bench
    rows.append(("bench", f"throughput at concurrency {b.concurrency}" if b.concurrency else "no throughput bench"))
    return rows


def print_plan(cfg: Recipe) -> None:
    print(f"eyas run --plan: {cfg.run.out} (nothing started, fetched or written)")
    for stage, what in plan(cfg):
        print(f"  {stage:8s} {what}")
