"""Typed configs: one dataclass per stage, recipes as YAML, `section.field=value` overrides.

A recipe is a YAML file with one mapping per stage section (see `recipes/demo.yaml`).
Everything is resolved into a `Recipe` of plain dataclasses; unknown keys are refused
with the list of valid keys so that a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from eyas.io import read_text

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"


@dataclass
class ModelsConfig:
    """Stage 0: which target to fetch / resolve (a registry name or a local HF dir)."""

    target: str = ""  # default: run.target
    check: bool = True  # after conversion, load and generate a reply through the chat template


@dataclass
class DataConfig:
    """Stage 0: prompt sources normalized to `{"id", "domain", "messages"}` JSONL."""

    sources: list[str] = field(default_factory=lambda: ["sharegpt", "gsm", "humaneval", "multilingual", "pydoc"])
    out: str = ""  # default: $EYAS_HOME/data
    max_per_source: int = 2000  # 0 = all
    eval_fraction: float = 0.05
    seed: int = 0


@dataclass
class SynthConfig:
    """Stage 1: the target writes the assistant turns (vLLM in-process or endpoints)."""

    target: str = ""  # default: run.target
    prompts: str = ""
    out: str = ""
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    limit: int = 0  # 0 = every prompt
    endpoint: list[str] = field(default_factory=list)  # OpenAI-compatible base URLs
    concurrency: int = 8  # sequences in flight per endpoint or in the in-process engine (max_num_seqs)
    serve: bool = False  # start a local `vllm serve` for the target and drive it
    chat_template: str = ""  # a template file, as `vllm serve --chat-template` takes it
    turns: Literal["regenerate", "last"] = "regenerate"  # regenerate every assistant turn, or the last only
    max_model_len: int = 2048
    kv_cache_gib: float = 2.0  # VLLM_CPU_KVCACHE_SPACE on CPU
    enforce_eager: bool = True  # skip torch.compile: ~4x faster start-up on CPU, ~20% slower decode
    engine: Literal["vllm", "hf"] = "vllm"  # hf: transformers' batched greedy generation, where vLLM is missing
    dtype: Literal["auto", "bf16", "fp32"] = "auto"  # the target's dtype (auto: eyas.host.engine_dtype)
    device: str = "cpu"  # hf engine: where the target runs (cpu, cuda:0, ...)
    max_seconds: float = 0  # of generation: then no reply starts, those in the engine finish (0: no limit)
    # continuous: a conversation's next turn enters the engine as soon as its reply is back (vLLM in-process,
    # endpoints); turns: every conversation's turn t before any turn t+1 (the hf engine always does this)
    schedule: Literal["continuous", "turns"] = "continuous"
    # keep the target's hidden states of every token it runs while it writes (vLLM in this process), in
    # OUT/captured: the extract stage takes them instead of running those conversations again (#33)
    capture: bool = False
    capture_layer_ids: list[int] = field(default_factory=list)  # empty: extract's default; eyas run: extract.layer_ids


@dataclass
class ExtractConfig:
    """Stage 2: aux hidden states (+ final normed state) per token, with the loss mask."""

    target: str = ""  # default: run.target
    data: str = ""
    out: str = ""
    backend: Literal["hf", "vllm"] = "hf"
    mode: Literal["offline", "online", "streaming"] = "offline"
    layer_ids: list[int] = field(default_factory=list)  # empty: (2, L//2, L-3)
    dtype: Literal["bf16", "fp8"] = "bf16"  # storage
    max_len: int = 0  # tokens per conversation; 0: the synthesis' max_model_len (its manifest), else 2048
    samples_per_shard: int = 64
    limit: int = 0
    verify: str = ""  # a feature dir to verify instead of extracting
    compute_dtype: Literal["auto", "bf16", "fp32"] = "auto"  # the target's dtype (auto: hf bf16, vllm eyas.host.engine_dtype)
    device: str = "cpu"  # hf backend: where the target runs (cpu, cuda:0, ...)
    batch_tokens: int = 8192  # hf backend: padded tokens per forward
    chat_template: str = ""  # a template file, as `vllm serve --chat-template` takes it
    kv_cache_gib: float = 1.0  # vllm backend: VLLM_CPU_KVCACHE_SPACE on CPU
    connect: list[str] = field(default_factory=list)  # streaming: consumer addresses (tcp://host:port)
    shard: str = ""  # streaming: "i/n" = this producer takes conversations i, i+n, ...
    epochs: int = 1  # streaming: passes over the data (0 = until the consumers stop)


@dataclass
class TrainConfig:
    """Stage 3: cold-start EAGLE-3 head with the TTT loss under FSDP2 (over 2+ ranks)."""

    target: str = ""  # default: run.target
    features: str = ""
    out: str = ""
    source: Literal["offline", "online", "streaming"] = "offline"
    max_steps: int = 200
    # wall-clock budget for the steps (0: none): the trainer times its first steps and trains min(max_steps, what
    # fits), the cosine horizon with it; serve-evals and saves are outside it (eyas.train.budget)
    max_minutes: float = 0.0
    resume: bool = False
    trust_checkpoint: bool = False  # resume from DCP files eyas did not sign here (reading DCP unpickles)
    ttt_steps: int = 7
    position_decay: float = 0.8
    draft_vocab_size: int = 8192
    lr: float = 1e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    grad_accum: int = 1
    token_budget: int = 4096  # tokens per micro-batch per rank
    max_len: int = 0  # tokens per sample; 0: the features' max_len (online: the synthesis' max_model_len), else 2048
    seed: int = 0
    log_every: int = 10
    save_every: int = 100
    eval_every: int = 0  # serve-eval every N steps (0: only at the end), measured with the eval section
    eval_limit: int = 16  # serve-eval on the first N prompts of eval.prompts (0: all)
    # serve-eval the last checkpoint when no earlier one was due (nothing to choose between); eyas run
    # sets false: its eval stage measures that draft on every held-out prompt
    eval_lone_final: bool = True
    holdout: int = 0  # offline: feature samples kept out of training; their simulated AL is logged at each evaluation
    max_samples: int = 0  # offline: train on this many of the other samples (0: all; nested subsets for learning curves)
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    fc_norm: bool = False
    # the draft layer's size; 0: from the target (eyas.draft.spec.draft_geometry: an MLA target's value head
    # dim and one kv head per head, a MoE target's expert width replaced by 4 x hidden)
    draft_num_heads: int = 0
    draft_num_kv_heads: int = 0
    draft_head_dim: int = 0
    draft_intermediate_size: int = 0
    freeze_embed: bool = True
    init_head: Literal["random", "target"] = "random"  # target: lm_head and final norm start as the target's
    init_layer: Literal["random", "target"] = "random"  # target: the layer from the target's first and last, fc = top aux
    hard_label: float = 0.0  # weight of CE on the target's argmax mixed into the soft CE (0: soft only)
    loss: Literal["kl", "lk"] = "kl"  # kl: soft CE to the target; lk: -log acceptance probability (-log Σ min(p, q))
    min_target_prob: float = 0.0  # train only positions where the target's top draft-vocab prob >= this (0: all)
    optimizer: Literal["adamw", "muon"] = "adamw"  # muon: Muon (eyas.train.muon) on fc and the layer's matrices
    init_from: str = ""  # warm start: an exported draft dir (eyas, vLLM or speculators format) for this target
    loss_tokens: Literal["assistant", "all"] = "assistant"  # all: prompt tokens too, against the target's distributions
    score_every: int = 1  # accuracy metrics on every Nth micro-batch (the target's full-vocab top-1: about 1/4 of a CPU step here)
    layer_ids: list[int] = field(default_factory=list)  # online source: empty = (2, L//2, L-3); offline: the features'
    lr_decay_steps: int = 0  # cosine horizon (0 = max_steps); fix it to stop early and resume on the same schedule
    threads: int = 0  # torch intra-op threads per rank (0 = torch's default; 1 is fastest on a busy small CPU)
    # auto: FSDP2 over 2+ ranks, the bare module (bf16 through autocast) in a world of one (1.10x the
    # demo trainer's tokens/s on a 2-core CPU, 1.2-1.3x in a probe: docs/tokens-per-hour.md); always: FSDP2 on one rank too
    fsdp: Literal["auto", "always"] = "auto"
    progress: bool = True  # tqdm bar on rank 0


@dataclass
class ExportConfig:
    """Stage 5: a draft directory vLLM loads unchanged."""

    run: str = ""
    out: str = ""
    checkpoint: str = "best"  # best | latest | step_N
    format: Literal["vllm", "speculators"] = "vllm"
    dtype: Literal["bf16", "fp8", "fp8-emulated"] = "bf16"  # fp8-emulated: fp8-rounded weights stored as bf16, for vLLM CPU
    verify: bool = False  # reload the draft in vLLM with the target and decode a few tokens speculatively
    target: str = ""  # default: the target recorded in the checkpoint (not run.target)
    keep_embed: bool = False  # keep embed_tokens even when it equals the target's
    # ngram:MIN:MAX[:RULE] | suffix[:RULE]: prompt lookup served beside the draft by eyas's vLLM plugin
    # (eyas.hybrid_serve); auto (eyas run): the best of lookup_candidates on the eval prompts, if it beats the draft alone
    lookup: str = "none"
    lookup_candidates: list[str] = field(default_factory=lambda: ["ngram:2:4:lookup>draft", "ngram:3:4:lookup>draft",
                                                                  "suffix:lookup>draft"])  # suffix: where it is built


@dataclass
class EvalConfig:
    """Stage 4: true acceptance length from vLLM's spec-decode counters (`eyas eval`, and serve-eval in training)."""

    target: str = ""  # default: run.target
    draft: str = ""  # an exported draft dir, ngram[:MIN:MAX] (vLLM prompt lookup) or none (plain decoding)
    prompts: str = ""  # held-out {"id", "domain", "messages"} JSONL (serve-eval's too)
    k: int = 3  # num_speculative_tokens: measured here and in serve-eval, written by export, served by bench
    max_tokens: int = 128
    limit: int = 0
    temperature: float = 0.0
    max_model_len: int = 2048
    kv_cache_gib: float = 2.0
    out: str = ""  # write the JSON report here too
    by_domain: bool = True  # one batch per domain in the same engine (per-domain counters)
    timeout: int = 3600  # seconds for the vLLM subprocess
    eager: bool = True  # no torch.compile / CUDA graphs: fast start, slower decode (AL unaffected)
    ngram: bool = True  # `eyas run`: also serve vLLM's n-gram lookup on the same prompts (the bar a draft must beat)
    suffix: bool = True  # `eyas run`, with ngram: also suffix decoding (where arctic-inference is built)


@dataclass
class QuantizeConfig:
    """MXFP4 (OCP MX) target in AMD Quark's format."""

    model: str = ""
    out: str = ""
    scheme: Literal["mxfp4"] = "mxfp4"
    layers: Literal["all", "experts"] = "all"  # experts: routed experts only (AMD's published MXFP4 MoE checkpoints)
    exclude: list[str] = field(default_factory=lambda: ["lm_head"])
    activations: Literal["none", "mxfp4"] = "none"
    emulate: bool = False


@dataclass
class BenchConfig:
    """Benchmarks: acceptance per domain / context bucket, throughput vs baseline."""

    target: str = ""  # default: run.target
    draft: str = ""  # an exported draft dir, ngram[:MIN:MAX] (vLLM prompt lookup) or none (plain decoding)
    out: str = ""
    prompts: str = ""  # eval prompts JSONL (default: the held-out split of the data mix)
    what: Literal["al", "throughput", "extract", "train", "quant", "drift", "threads", "simulated", "levers",
                  "curve", "rules", "synth"] = "al"
    concurrency: list[int] = field(default_factory=lambda: [1, 4])
    context_buckets: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])  # `bench al`: prompt tokens
    per_bucket: int = 8
    max_tokens: int = 256
    limit: int = 16  # prompts per domain (throughput, drift, threads on the recipe's eval split)
    per_category: int = 40  # `bench al`: prompts per suite category (eyas.bench.suite)
    categories: list[str] = field(default_factory=list)  # `bench al`: suite categories (default: all)
    exclude: list[str] = field(default_factory=list)  # training splits no suite prompt may be in (default: RUN/data/train.jsonl beside --draft, else the recipe's mix)
    # measured beside the draft: none (the target alone: `bench al` counts greedy replies that differ from its),
    # ngram[:MIN:MAX], suffix (where arctic-inference is built), hybrid[:ngram:MIN:MAX[:RULE]] (the draft with
    # prompt lookup: its exported policy, else ngram:2:4)
    baselines: list[str] = field(default_factory=lambda: ["none", "ngram", "suffix", "hybrid"])
    sweep_k: bool = False  # `bench throughput`: every k of k_values at every sweep_concurrency
    k_values: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])
    sweep_concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    repeats: int = 2  # `bench throughput`: readings of every server at every concurrency (order rotates)
    input_len: int = 0  # `bench throughput`: 0 = suite prompts; N = pydoc prompts of N tokens (1024 = the seed's 1K/1K)
    seed: int = 0
    levers: list[str] = field(default_factory=list)  # `bench levers` rows: "NAME: section.key=value, ..."
    curve_samples: list[int] = field(default_factory=lambda: [60, 120, 240, 0])  # `bench curve`: train.max_samples
    curve_steps: list[int] = field(default_factory=list)  # `bench curve`: train.max_steps per point (default: train's)
    # `bench synth` rows beside the recipe's own synth section ("NAME: synth.key=value, ..."), on the first
    # synth_limit conversations of the recipe's training split
    synth_rows: list[str] = field(default_factory=lambda: ["c128: synth.concurrency=128, synth.kv_cache_gib=4"])
    synth_limit: int = 128
    rules: list[str] = field(default_factory=lambda: ["lookup>draft", "lookupL>=3", "lookupL>=4", "conf<0.3",
                                                      "conf<0.5", "agree"])  # `bench rules` (eyas.draft.hybrid)


@dataclass
class RunConfig:
    """`eyas run`: where the end-to-end pipeline writes, and which target it trains for."""

    target: str = "smollm2-135m-instruct"
    out: str = "runs/demo"
    quantized_target: bool = False  # quantize the target to MXFP4 and run every stage against it
    nproc: int = 1  # training ranks (torchrun) for `eyas run`
    trust_remote_code: bool = False  # let transformers / vLLM run the target checkpoint's own code
    language_model_only: bool = False  # a multimodal target (Kimi-K2.5) runs text-only in vLLM: no vision tower
    plan: bool = False  # `eyas run --plan`: print what each stage would do and make here; start nothing
    # the whole run's wall clock from this command's start (0: none): training gets what is left of it less
    # reserve_minutes, at most train.max_minutes, so a slower machine trains fewer steps instead of running
    # late (eyas.train.budget); a resumed run keeps the step count its first fit chose
    max_minutes: float = 0.0
    reserve_minutes: float = 15.0  # of run.max_minutes: kept for the stages after training (export, eval, bench)


@dataclass
class Recipe:
    run: RunConfig = field(default_factory=RunConfig)
    models: ModelsConfig = field(default_factory=ModelsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    synth: SynthConfig = field(default_factory=SynthConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)


SECTIONS: dict[str, type] = typing.get_type_hints(Recipe)

# Keys that moved, so older recipes, overrides and flags keep working: section.key -> where it lives now.
ALIASES: dict[tuple[str, str], tuple[str, str]] = {
    ("export", "k"): ("eval", "k"),
    ("bench", "k"): ("eval", "k"),
    ("train", "eval_prompts"): ("eval", "prompts"),
}


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Coerce a YAML value to the annotated field type; ValueError names `where`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], where)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v != ""]
        if not isinstance(value, (list, tuple)):
            value = [value]
        return [_coerce(v, item_tp, where) for v in value]
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ValueError(f"{where}: {value!r} is not one of {' | '.join(map(str, allowed))}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ValueError(f"{where}: expected true/false, got {value!r}")
    if tp in (int, float):
        if isinstance(value, bool):
            raise ValueError(f"{where}: expected a number, got {value!r}")
        try:
            out = tp(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: expected {tp.__name__}, got {value!r}") from None
        if tp is int and isinstance(value, float) and value != out:
            raise ValueError(f"{where}: expected an integer, got {value!r}")
        return out
    if tp is str:
        if value is None:
            return ""
        if isinstance(value, (dict, list)):
            raise ValueError(f"{where}: expected a string, got {value!r}")
        if isinstance(value, bool):  # YAML reads no/yes/off/on as booleans
            raise ValueError(f"{where}: expected a string, got the boolean {value!r}; quote it (\"no\") in YAML")
        return str(value)
    raise AssertionError(f"unsupported config type {tp} at {where}")


def _valid_keys(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def update_section(obj: Any, values: dict[str, Any], where: str) -> None:
    """Set fields of a section dataclass from a mapping; unknown keys are refused."""
    hints = typing.get_type_hints(type(obj))
    for key, value in values.items():
        if key not in hints:
            raise ValueError(
                f"{where}: unknown key {key!r}; valid keys of this section: {', '.join(_valid_keys(type(obj)))}"
            )
        setattr(obj, key, _coerce(value, hints[key], f"{where}.{key}"))


def set_values(cfg: Recipe, section: str, values: dict[str, Any], where: str) -> None:
    """`update_section` on a recipe's section, with moved keys (ALIASES) set where they live now."""
    own = {}
    for key, value in values.items():
        if (section, key) in ALIASES:
            to_section, to_key = ALIASES[(section, key)]
            update_section(getattr(cfg, to_section), {to_key: value}, f"{where} ({section}.{key} is {to_section}.{to_key})")
        else:
            own[key] = value
    update_section(getattr(cfg, section), own, where)


def choices(section: type, name: str) -> tuple[str, ...]:
    """The values a `Literal[...]` field of a section accepts (one definition: the annotation)."""
    return typing.get_args(typing.get_type_hints(section)[name])


def check_choices(section: Any, where: str = "") -> None:
    """Every `Literal[...]` field of a section object holds one of its values (ValueError names the field).

    `finalize` runs it on every section; a stage handed a section built in code runs it first."""
    name = where or type(section).__name__
    for key, tp in typing.get_type_hints(type(section)).items():
        if typing.get_origin(tp) is Literal and getattr(section, key) not in typing.get_args(tp):
            raise ValueError(f"{name}.{key}: {getattr(section, key)!r} is not one of "
                             f"{' | '.join(map(str, typing.get_args(tp)))}")


INHERITS_TARGET = ("models", "synth", "extract", "train", "eval", "bench")  # export: the checkpoint's own


def finalize(cfg: Recipe) -> Recipe:
    """The run's shared facts, applied once after every override: a stage section without a
    `target` takes `run.target`; every Literal field holds one of its values."""
    for name in INHERITS_TARGET:
        sec = getattr(cfg, name)
        if not sec.target:
            sec.target = cfg.run.target
    for name in SECTIONS:
        check_choices(getattr(cfg, name), name)
        check_bounds(getattr(cfg, name), name)
    return cfg


# Numbers must be >= 0 (no field has a meaning below 0); these must be > 0, these are fractions.
POSITIVE = {"run.nproc", "synth.max_tokens", "synth.concurrency", "synth.max_model_len", "synth.kv_cache_gib",
            "synth.top_p", "extract.samples_per_shard", "extract.batch_tokens", "extract.kv_cache_gib",
            "train.max_steps", "train.ttt_steps", "train.position_decay", "train.draft_vocab_size", "train.lr",
            "train.grad_clip", "train.grad_accum", "train.token_budget",
            "eval.k", "eval.max_tokens", "eval.max_model_len", "eval.kv_cache_gib", "eval.timeout",
            "bench.concurrency", "bench.context_buckets", "bench.per_bucket", "bench.max_tokens",
            "bench.per_category", "bench.synth_limit", "bench.k_values", "bench.sweep_concurrency", "bench.repeats"}
FRACTIONS = {"data.eval_fraction", "synth.top_p", "train.position_decay", "train.min_lr_ratio", "train.hard_label",
             "train.min_target_prob"}


def check_bounds(section: Any, where: str) -> None:
    """Every number of a section (list items too) within its field's range; ValueError names the field."""
    for key, tp in typing.get_type_hints(type(section)).items():
        name = f"{where}.{key}"
        vals = getattr(section, key)
        vals = vals if isinstance(vals, list) else [vals]
        for v in vals:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if v < 0 or (name in POSITIVE and v <= 0):
                need = "> 0" if name in POSITIVE else ">= 0"
                raise ValueError(f"{name}: {v!r} must be {need}")
            if name in FRACTIONS and v > 1:
                raise ValueError(f"{name}: {v!r} is a fraction, at most 1")


def resolve_recipe_path(recipe: str) -> Path:
    """A recipe is a name under `recipes/` (`demo`) or a path to a YAML file."""
    p = Path(recipe)
    if p.suffix in (".yaml", ".yml") or p.is_file():
        if not p.exists():
            raise ValueError(f"recipe file {p} does not exist")
        return p
    cand = RECIPES_DIR / f"{recipe}.yaml"
    if not cand.exists():
        names = sorted(x.stem for x in RECIPES_DIR.glob("*.yaml"))
        raise ValueError(f"unknown recipe {recipe!r}; known recipes: {', '.join(names)} (or give a path to a .yaml)")
    return cand


def load_recipe(recipe: str | None = None, overrides: list[str] | None = None) -> Recipe:
    """Defaults, then the recipe file, then `section.field=value` overrides, then `finalize`."""
    cfg = read_recipe(recipe)
    for ov in overrides or []:
        apply_override(cfg, ov)
    return finalize(cfg)


def read_recipe(recipe: str | None = None) -> Recipe:
    """Defaults, then the recipe file: not finalized (overrides may follow)."""
    cfg = Recipe()
    if recipe:
        path = resolve_recipe_path(recipe)
        try:
            raw = yaml.safe_load(read_text(path)) or {}
        except yaml.YAMLError as e:
            raise ValueError(yaml_error_line(path, e)) from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: a recipe must be a mapping of sections ({', '.join(SECTIONS)})")
        for section, values in raw.items():
            if section not in SECTIONS:
                raise ValueError(f"{path}: unknown section {section!r}; valid sections: {', '.join(SECTIONS)}")
            if not isinstance(values, dict):
                raise ValueError(f"{path}: section {section!r} must be a mapping of keys")
            set_values(cfg, section, values, f"{path.name}:{section}")
    return cfg


def yaml_error_line(path: Path, e: yaml.YAMLError) -> str:
    """One line for a YAML syntax error: FILE:LINE:COL and what the parser expected."""
    mark = getattr(e, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    what = " ".join(str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x) or str(e)
    return f"{where}: not valid YAML ({' '.join(what.split())}): fix the recipe there"


def apply_override(cfg: Recipe, override: str, default_section: str | None = None) -> None:
    """Apply `section.key=value` (or `key=value` when a default section is given)."""
    if "=" not in override:
        raise ValueError(f"override {override!r} must look like section.key=value")
    key, raw = override.split("=", 1)
    if "." in key:
        section, name = key.split(".", 1)
    elif default_section:
        section, name = default_section, key
    else:
        raise ValueError(f"override {override!r} must name its section: section.key=value ({', '.join(SECTIONS)})")
    if section not in SECTIONS:
        raise ValueError(f"override {override!r}: unknown section {section!r}; valid sections: {', '.join(SECTIONS)}")
    set_values(cfg, section, {name: _parse_raw(cfg, section, name, raw)}, f"override {section}")


def _parse_raw(cfg: Recipe, section: str, name: str, raw: str) -> Any:
    """A command-line value: taken as written for a string field (`run.out=no` is the dir "no",
    `export.checkpoint=0x10` the name "0x10"), read as YAML otherwise (numbers, lists, true/false)."""
    section, name = ALIASES.get((section, name), (section, name))
    tp = typing.get_type_hints(type(getattr(cfg, section))).get(name)
    if tp is str or raw == "":
        return raw
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw  # _coerce names the field and what it expected


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
