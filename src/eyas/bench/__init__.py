"""`eyas bench WHAT`: printed figures, measured side by side in one run.

    al          acceptance length per domain and per context-length bucket (vLLM counters)
    throughput  target + draft vs target alone, output tokens/s per concurrency (vLLM serving bench)
    extract     extraction tokens/s per backend vs a plain prefill; bytes per token per dtype (extract.*)
    train       training tokens/s and where the time goes (the recipe's train.* draft)
    quant       MXFP4 vs bf16 perplexity / next-token agreement; quantizer speed (quantize.exclude)
    drift       vLLM bf16 greedy text against an HF float32 forward (how on-policy synthesis is)
    threads     vLLM CPU thread layouts: synthesis and serving tokens/s side by side
    simulated   the simulated AL of a draft on its features against vLLM's on the same turns
    levers      an ablation table: each `bench.levers` row trained on the same features and served
                by vLLM on the held-out prompts, beside the baseline and n-gram prompt lookup
    curve       the learning curve: true AL against generated tokens (nested feature subsets), its
                fit and the data it predicts for AL 2.0 / 2.5 / 3.0
    rules       the draft or prompt lookup per step: each `bench.rules` rule simulated on held-out
                features, the pure draft and lookup also served in vLLM on the same turns
    synth       `eyas synth` tokens/s per setting (`bench.synth_rows`) side by side, with the share
                of this machine's matmul peak the target's FLOPs reach

Every result names the machine it ran on (`eyas.host.machine()`), printed first and
stored under "machine" in `bench_<what>.json`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from eyas.config import BenchConfig, Recipe, choices
from eyas.data import build_mix, data_root
from eyas.host import machine, machine_line
from eyas.models import resolve_target

WHATS = choices(BenchConfig, "what")


def _write(out: str, name: str, result) -> None:
    if out:
        p = Path(out)
        p.mkdir(parents=True, exist_ok=True)
        (p / f"bench_{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")


def _prompts(cfg: Recipe) -> Path:
    """--prompts, else the eval split of the recipe's data mix (as `eyas data mix` builds it)."""
    if cfg.bench.prompts:
        return Path(cfg.bench.prompts)
    d = cfg.data
    return build_mix(d.sources, d.max_per_source, d.seed, d.out or data_root() / "mix", d.eval_fraction)["eval"]


def _conversations(cfg: Recipe) -> list[list[dict]]:
    """The first user turn(s) of up to `bench.limit` prompts per domain of `_prompts(cfg)`."""
    from eyas.bench.acceptance import domain_prompts

    return [r["messages"] for r in domain_prompts(_prompts(cfg), cfg.bench.limit)]


def _exclude(cfg: Recipe) -> list[Path]:
    """bench.exclude, else the training split beside the draft's run (RUN/data/train.jsonl), else the recipe's mix."""
    b = cfg.bench
    if b.exclude:
        return [Path(p) for p in b.exclude if p]
    beside = Path(b.draft).parent / "data" / "train.jsonl"
    if beside.exists():
        return [beside]
    d = cfg.data
    return [build_mix(d.sources, d.max_per_source, d.seed, d.out or data_root() / "mix", d.eval_fraction)["train"]]


def _suite(cfg: Recipe, target: Path, max_model_len: int = 0) -> tuple[list[dict], dict]:
    """The acceptance suite's category prompts (eyas.bench.suite), none in `_exclude(cfg)`."""
    from eyas.bench.suite import CATEGORIES, build_suite
    from eyas.chat import load_chat_template, load_tokenizer, render_prompt_ids

    b = cfg.bench
    tok = load_tokenizer(target)
    tpl = load_chat_template(target, tok=tok)
    limit = max_model_len or 2048
    rows, info = build_suite(b.per_category, _exclude(cfg), b.seed, tuple(b.categories or CATEGORIES),
                             too_long=lambda r: len(render_prompt_ids(tok, r["messages"], tpl)) + b.max_tokens > limit)
    print(f"bench: suite of {len(rows)} prompts {info['per_category']}; training prompts dropped "
          f"{info['excluded']} (checked against {', '.join(info['exclude_files'])})", flush=True)
    if info["short"]:
        print(f"bench: warning: categories below {b.per_category} prompts: {info['short']}", flush=True)
    return rows, info


def _bench_al(cfg: Recipe, target: Path) -> dict:
    from eyas.bench.acceptance import bench_acceptance, bucket_prompts, suite_summary, write_suite
    from eyas.bench.throughput import proposers

    b = cfg.bench
    buckets, max_len = bucket_prompts(target, b.context_buckets, b.per_bucket, b.max_tokens, b.seed) \
        if b.context_buckets else ([], 2048)
    rows, info = _suite(cfg, target, max_len)
    cats = list(dict.fromkeys(r["domain"] for r in rows))
    labels = list(dict.fromkeys(r["domain"] for r in buckets))
    methods = proposers(None if b.draft.lower() == "none" else b.draft, b.baselines, cfg.eval.k)
    out = Path(b.out) if b.out else None
    if out:
        write_suite(rows + buckets, out / "suite.jsonl")
    res = bench_acceptance(target, methods, rows + buckets, cats, labels, cfg.eval.k, b.max_tokens, max_len, out)
    return {**res, "suite": suite_summary(info, rows + buckets)}


def _bench_throughput(cfg: Recipe, target: Path) -> dict:
    from eyas.bench.throughput import bench_sweep

    b = cfg.bench
    if b.input_len:  # the seed's shape: real text of input_len tokens, fixed output length
        from eyas.data import long_context_prompts

        n = b.repeats * sum(max(2 * c, 4) for c in (b.sweep_concurrency if b.sweep_k else b.concurrency)) + 2
        prompts = [r["messages"] for r in long_context_prompts(str(target), [b.input_len], n, seed=b.seed)]
    else:
        prompts = [r["messages"] for r in _suite(cfg, target)[0]]
        random.Random(b.seed).shuffle(prompts)
    ks, conc = (b.k_values, b.sweep_concurrency) if b.sweep_k else ([cfg.eval.k], b.concurrency)
    draft = None if b.draft.lower() == "none" else Path(b.draft)
    res = bench_sweep(target, draft, prompts, conc, ks, b.baselines, b.max_tokens, b.repeats,
                      max_model_len=max(2048, b.input_len + b.max_tokens + 64))
    if b.out:
        Path(b.out).mkdir(parents=True, exist_ok=True)
        (Path(b.out) / "bench_throughput.md").write_text(res["table"] + "\n")
    return res


def cli(cfg: Recipe, actions: list[str]) -> int:
    """`eyas bench WHAT`: the bench section, plus the sections of the stage a bench measures."""
    what = actions[0] if actions else cfg.bench.what
    if what not in WHATS:
        raise ValueError(f"unknown benchmark {what!r}; choose one of {', '.join(WHATS)}")
    b = cfg.bench
    target = resolve_target(b.target)
    print(f"bench {what}: machine: {machine_line()}", flush=True)
    if what in ("al", "throughput", "simulated", "rules") and not b.draft:
        raise ValueError(f"eyas bench {what} needs --draft DIR (an exported draft, e.g. RUNDIR/draft)")
    if what == "al":
        res = _bench_al(cfg, target)
    elif what == "throughput":
        res = _bench_throughput(cfg, target)
    elif what == "extract":
        from eyas.bench.extract import run_bench
        from eyas.extract.base import resolve_lengths

        e = resolve_lengths(cfg.extract)
        res = run_bench(target, b.limit, layer_ids=e.layer_ids or None,
                        compute_dtype="bf16" if e.compute_dtype == "auto" else e.compute_dtype, max_len=e.max_len,
                        batch_tokens=e.batch_tokens, data=e.data)
    elif what in ("levers", "curve"):
        if not b.out:
            raise ValueError(f"eyas bench {what} needs --out DIR (each row trains under DIR/{what}/NAME)")
        if what == "levers":
            from eyas.bench.levers import bench_levers

            res = bench_levers(cfg, b.levers, Path(b.out))
        else:
            from eyas.bench.curve import bench_curve

            res = bench_curve(cfg, b.curve_samples, Path(b.out), b.curve_steps)
    elif what == "train":
        from eyas.bench.train import run_bench

        res = run_bench(str(target), cfg.train, features=cfg.train.features)
    elif what == "drift":
        from eyas.bench.drift import bench_drift

        res = bench_drift(target, _conversations(cfg), b.max_tokens)
    elif what == "simulated":
        from eyas.bench.simulated import bench_simulated

        if not cfg.train.features:
            raise ValueError("eyas bench simulated needs train.features=FEAT (a feature dir; its conversations are replayed)")
        res = bench_simulated(target, Path(b.draft), Path(cfg.train.features), cfg.eval.k, b.limit, cfg.train.holdout)
    elif what == "rules":
        from eyas.bench.rules import bench_rules

        if not cfg.train.features:
            raise ValueError("eyas bench rules needs train.features=FEAT (the draft's feature dir: its held-out samples)")
        res = bench_rules(target, Path(b.draft), Path(cfg.train.features), cfg.eval.k, b.rules, limit=b.limit,
                          holdout=cfg.train.holdout)
    elif what == "synth":
        from eyas.bench.synth import bench_synth

        if not b.out:
            raise ValueError("eyas bench synth needs --out DIR (each row synthesizes under DIR/synth/NAME)")
        d = cfg.data
        prompts = build_mix(d.sources, d.max_per_source, d.seed, d.out or data_root() / "mix", d.eval_fraction)["train"]
        res = bench_synth(cfg, target, prompts, b.synth_rows, Path(b.out) / "synth", b.synth_limit, b.repeats)
    elif what == "threads":
        from eyas.bench.threads import bench_threads

        res = bench_threads(target, _conversations(cfg), b.concurrency, b.max_tokens)
    else:
        from eyas.bench.quant import run_bench

        res = run_bench(target, exclude=cfg.quantize.exclude, layers=cfg.quantize.layers)
    if isinstance(res, dict):
        res = {"machine": machine(), **res}
    else:
        res = {"machine": machine(), "rows": res}
    _write(b.out, what, res)
    return 0
