"""The training loop: build everything, resume, step, log, checkpoint, hand each checkpoint to a callback.

One optimizer step = world x grad_accum micro-batches of the global order (see
`eyas.train.data`); each micro-batch loss is the TTT loss (a mean over its loss tokens),
divided by grad_accum; FSDP2 averages over ranks. So a step's gradient is the mean over
its micro-batches whatever the split between ranks and accumulation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eyas.acceptance import summarize as summarize_acceptance
from eyas.checkpoints import checkpoint_step, latest_checkpoint, repair_latest
from eyas.config import TrainConfig, check_bounds, check_choices
from eyas.draft.exported import load_warm_start
from eyas.draft.model import Eagle3Draft
from eyas.draft.simulate import simulate_samples
from eyas.draft.spec import DraftSpec, draft_config_dict, spec_dict
from eyas.draft.ttt import STAT_KEYS as STAT_ORDER
from eyas.draft.ttt import TargetHead, ttt_loss
from eyas.draft.vocab import DraftVocab, build_draft_vocab, vocab_coverage
from eyas.faults import failpoint
from eyas.io import remove_temp_files
from eyas.lock import writing
from eyas.manifest import read_manifest, sha256_file, sha256_text, write_manifest
from eyas.models import eyas_home, resolve_target
from eyas.stage import ChangedOutput, inherited, output_dir
from eyas.target import load_head, target_final_norm, target_layer, text_config
from eyas.train import parallel as P
from eyas.train.budget import StepBudget, resumed_max_steps
from eyas.train.checkpoint import load_checkpoint, save_checkpoint
from eyas.train.data import collate, open_data
from eyas.train.metrics import MetricsLogger, format_line, summarize
from eyas.train.muon import Muon


class WarmupCosine:
    """lr(step) = linear warmup to lr, then cosine to lr * min_lr_ratio at `decay_steps`."""

    def __init__(self, lr: float, warmup: int, decay_steps: int, min_ratio: float):
        self.lr, self.warmup, self.decay_steps, self.min_ratio = lr, max(0, warmup), max(1, decay_steps), min_ratio

    def __call__(self, step: int) -> float:
        """lr for the optimizer step that follows `step` completed steps."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        t = min(1.0, (step - self.warmup) / max(1, self.decay_steps - self.warmup))
        return self.lr * (self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))

    def state_dict(self) -> dict[str, Any]:
        return {"lr": self.lr, "warmup": self.warmup, "decay_steps": self.decay_steps, "min_ratio": self.min_ratio}

    def load_state_dict(self, st: dict[str, Any]) -> None:
        self.lr, self.warmup, self.decay_steps, self.min_ratio = st["lr"], st["warmup"], st["decay_steps"], st["min_ratio"]


def _log(msg: str, d: P.Dist | None = None) -> None:
    if d is None or d.is_main:
        print(f"eyas train: {msg}", file=sys.stderr, flush=True)


def resolve_lengths(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with `max_len` set: given, or what its source was made with (the features' max_len; the
    synthesis' max_model_len for online conversations), else 2048 (a stream)."""
    if cfg.source == "offline":
        n = inherited(cfg.max_len, cfg.features, "extract", "max_len", 2048)
    elif cfg.source == "online":
        n = inherited(cfg.max_len, cfg.features, "synth", "max_model_len", 2048)
    else:
        n = cfg.max_len or 2048
    return dataclasses.replace(cfg, max_len=n)


def check_config(cfg: TrainConfig) -> None:
    output_dir(cfg.out, "--out")  # a run dir resumes by checkpoint (eyas.checkpoints), not by manifest key
    if not cfg.target:
        raise ValueError("no target: pass --target NAME|DIR")
    check_bounds(cfg, "train")  # the recipe's ranges, for a section built in code too
    if cfg.token_budget < 8 or cfg.max_len < 8:
        raise ValueError("token_budget and max_len must be >= 8")
    if (cfg.holdout or cfg.max_samples) and cfg.source != "offline":
        raise ValueError(f"train.holdout and train.max_samples need train.source=offline (got {cfg.source!r})")
    if cfg.min_target_prob >= 1:
        raise ValueError(f"train.min_target_prob is a probability threshold below 1; got {cfg.min_target_prob}")
    if cfg.init_from and (cfg.init_head != "random" or cfg.init_layer != "random"):
        raise ValueError("train.init_from starts from a trained draft: leave train.init_head and train.init_layer random")
    check_choices(cfg, "train")


def build_vocab(cfg: TrainConfig, src, vocab_size: int, d: P.Dist, init: Eagle3Draft | None = None):
    """Rank 0 counts (or hits the content-keyed cache); every rank gets the same ids. A warm start
    keeps its draft's ids (its lm_head rows are theirs); the count then gives their coverage."""
    size = min(cfg.draft_vocab_size, vocab_size)

    def count():
        if init is not None:
            ids = init.draft_ids()
            return ids.tolist(), vocab_coverage(ids, src.ids_masks(), vocab_size)
        v = build_draft_vocab(src.ids_masks(), size, vocab_size, cache_dir=eyas_home() / "draft_vocab")
        return v.draft_ids.tolist(), v.info()

    ids, info = on_main(count, d)
    return DraftVocab(torch.tensor(ids, dtype=torch.int64), vocab_size, info["coverage"], info["num_tokens"],
                      info["num_seen"], info["key"])


def on_main(fn, d: P.Dist):
    """Run fn on rank 0 and give every rank its result; an error there is raised on every rank."""
    out, err = None, None
    if d.is_main:
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
            err = e
    if d.world == 1:
        if err is not None:
            raise err
        return out
    brief = None if err is None else (type(err).__name__, str(err), getattr(err, "errno", None),
                                      getattr(err, "filename", None))
    out, msg = P.broadcast_object((out, brief), d)
    if err is not None:
        raise err
    if msg is not None:
        if msg[2] is not None:  # an OSError (a full disk, a read-only dir): the same one on every rank
            raise OSError(msg[2], os.strerror(msg[2]), msg[3])
        raise (ValueError if msg[0] in ("ValueError", "Busy") else RuntimeError)(f"on rank 0: {msg[1]}")
    return out


# (checkpoint dir, step, the trainer's estimates: est_al, and sim_al / sim_per_pos with train.holdout) -> a record
# to log (or None). Runs on rank 0 while the other ranks wait; `eyas train` builds it from the recipe's eval
# section (eyas.serve_eval).
# (checkpoint dir, step, estimates) -> a record. A callback may also have `measured(step) -> bool`: a
# resumed run then re-measures the checkpoint it resumes from when that one was due and never measured
# (the run was killed during its evaluation).
CheckpointCallback = Callable[[Path, int, "dict[str, Any]"], "dict[str, Any] | None"]


def train(cfg: TrainConfig, on_checkpoint: CheckpointCallback | None = None) -> dict[str, Any]:
    """Run (or resume) training; returns the final summary. Works under torchrun or alone.

    on_checkpoint: called (rank 0) after every checkpoint due for evaluation (`train.eval_every`
    and the last one); its record's `acceptance_length` goes to TensorBoard."""
    cfg = resolve_lengths(cfg)
    check_config(cfg)
    d = P.init_distributed()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        # rank 0 holds the run dir's lock (eyas.lock): a second run on it is refused; the other ranks work inside it
        with writing(output_dir(cfg.out, "--out"), "eyas train") if d.is_main else contextlib.nullcontext():
            trainer = Trainer(cfg, d, on_checkpoint)
            if trainer.done is not None:
                return trainer.done
            try:
                return trainer.fit()
            finally:
                trainer.close()
    finally:
        P.destroy(d)


@dataclass
class Draft:
    """What one optimizer step needs: the draft, its optimizer and schedule, the frozen target head."""

    spec: Any  # DraftSpec
    model: torch.nn.Module  # Eagle3Draft (FSDP2-wrapped over 2+ ranks)
    opt: torch.optim.Optimizer | Optimizers
    sched: WarmupCosine
    head: Any  # TargetHead
    trainable: list[torch.nn.Parameter]
    autocast: bool = False  # bf16 compute through torch.autocast (the bare module; FSDP2 casts by its policy)
    sharded: bool = False  # wrapped in FSDP2

    def compute(self) -> contextlib.AbstractContextManager:
        """The context every forward of the draft runs in (training and simulation)."""
        dev = next(self.model.parameters()).device.type
        return torch.autocast(dev, dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()


class Optimizers(list):
    """Several torch optimizers stepped as one (DCP's get_state_dict takes the list as it is)."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self for g in o.param_groups]

    def step(self) -> None:
        for o in self:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self:
            o.zero_grad(set_to_none=set_to_none)


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module, precision: str) -> torch.optim.Optimizer | Optimizers:
    """AdamW on every trainable parameter; with `optimizer: muon`, Muon on the 2-D matrices of
    `fc` and the decoder layer (its lr matched to AdamW's update RMS, so one schedule drives both) and
    AdamW on the rest (norms, lm_head: Muon is for hidden matrices, not output layers). Muon is
    torch's, its Newton-Schulz iteration in the compute `precision` (bf16 | fp32: eyas.train.muon)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    adamw = dict(lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW([p for _, p in named], **adamw)
    hidden = [p for n, p in named if p.ndim == 2 and (n.startswith("fc.") or n.startswith("midlayer."))]
    ids = {id(p) for p in hidden}
    return Optimizers([
        Muon(hidden, ns_dtype=precision, lr=cfg.lr, weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW([p for _, p in named if id(p) not in ids], **adamw),
    ])


def build_draft(cfg: TrainConfig, target_dir: str, tcfg: Any, layer_ids: list[int], vocab: Any, device: torch.device,
                precision: str, d: P.Dist | None = None, timed_head: bool = False,
                init: Eagle3Draft | None = None) -> Draft:
    """The draft for `target_dir` (embedding copied, deterministic init; `init`: a warm start's
    spec and weights), its optimizer, the lr schedule and the target head, on `device`; sharded
    with FSDP2 when `d` is given and `P.shards` says so (2+ ranks, or `train.fsdp: always`)."""
    embed, lm_head, tcfg_d = load_head(target_dir)
    if init is not None:
        spec = init.spec
        model = Eagle3Draft(spec, freeze_embed=cfg.freeze_embed)
        model.load_state_dict(init.state_dict())
    else:
        spec = DraftSpec.from_target_config(
            tcfg, layer_ids, vocab.size, fc_norm=cfg.fc_norm, num_heads=cfg.draft_num_heads,
            num_kv_heads=cfg.draft_num_kv_heads, head_dim=cfg.draft_head_dim,
            intermediate_size=cfg.draft_intermediate_size)
        model = Eagle3Draft(spec, freeze_embed=cfg.freeze_embed)
        model.init_weights(embed.float(), seed=cfg.seed)
    if cfg.init_layer == "target":
        model.init_layer(target_layer(target_dir, 0), target_layer(target_dir, -1))
    if cfg.init_head == "target":
        model.init_head(lm_head[vocab.draft_ids].float(), target_final_norm(target_dir))
    model.set_vocab(vocab.d2t, vocab.t2d)
    model.to(device)
    sharded = d is not None and P.shards(d, cfg.fsdp)
    if sharded:
        P.apply_fsdp(model, d, precision)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(cfg, model, precision)
    sched = WarmupCosine(cfg.lr, cfg.warmup_steps, cfg.lr_decay_steps or cfg.max_steps, cfg.min_lr_ratio)
    head_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    head = TargetHead(lm_head, vocab.draft_ids, softcap=tcfg_d.get("final_logit_softcapping"),
                      logit_scale=float(tcfg_d.get("logit_scale") or 1.0), timed=timed_head).to(device, head_dtype)
    return Draft(spec, model, opt, sched, head, trainable, autocast=precision == "bf16" and not sharded,
                 sharded=sharded)


# What a resume may change: how long, how often to save / log / evaluate, threads and trust. Everything
# else (data, lr, loss, draft shape, ...) changes the run, so a run dir holding it is refused.
RESUME_MAY_CHANGE = {"target", "out", "max_steps", "max_minutes", "resume", "trust_checkpoint", "save_every", "eval_every",
                     "eval_limit", "eval_lone_final", "log_every", "score_every", "threads", "progress", "lr_decay_steps", "fsdp"}


def settings_changed(prev: dict[str, Any], cfg: TrainConfig) -> list[str]:
    """`key: old -> new` for each training setting that differs from the run's manifest (keys the
    manifest predates are taken as unchanged; paths compared resolved)."""
    now = dataclasses.asdict(cfg)
    out = []
    for key, old in prev.items():
        if key in RESUME_MAY_CHANGE or key not in now:
            continue
        new = now[key]
        if key in ("features", "init_from") and old and new:
            same = Path(old).resolve() == Path(new).resolve()
        else:
            same = old == new
        if not same:
            out.append(f"train.{key}: {old!r} -> {new!r}")
    return out


def data_identity(cfg: TrainConfig) -> str:
    """What the run trains on, as a hash: the features' shard checksums (offline), the conversations
    file (online); "" for a stream (its producers check their own inputs)."""
    if cfg.source == "offline":
        man = read_manifest(cfg.features) or {}
        return sha256_text(json.dumps([man.get("data_sha256"), [s.get("sha256") for s in man.get("shards", [])]]))
    if cfg.source == "online" and Path(cfg.features).is_file():
        return sha256_file(cfg.features)
    return ""


def check_provenance(features: dict[str, Any], where: str, target_dir: str) -> None:
    """Offline features must come from this target: same tokenizer files, same weights (by
    `target_fingerprint`, when the features recorded one). Hidden states of another model with the
    same width would train a draft that vLLM loads and that accepts nothing."""
    from eyas.manifest import tokenizer_hash
    from eyas.target import target_fingerprint

    made_by = features.get("target", "?")
    if features.get("tokenizer_hash") and features["tokenizer_hash"] != tokenizer_hash(target_dir):
        raise ValueError(f"{where}: made with the tokenizer of {made_by}, not of the target {target_dir}: "
                         "extract features from this target (or train for theirs)")
    if features.get("target_fingerprint") and features["target_fingerprint"] != target_fingerprint(target_dir):
        raise ValueError(f"{where}: made by {made_by}, whose weights differ from the target {target_dir}: "
                         "extract features from this target (or train for theirs)")


def resume_point(cfg: TrainConfig, data_id: str | None = None) -> tuple[Path | None, int]:
    """The checkpoint a run in `cfg.out` continues from and its step ((None, 0): a new run). A run dir
    trained with other settings or data is a ChangedOutput; a damaged latest checkpoint names itself."""
    run_dir = Path(cfg.out)
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return None, 0
    prev = read_manifest(run_dir) or {}
    changed = settings_changed(prev.get("config") or {}, cfg)
    data_id = data_identity(cfg) if data_id is None else data_id
    if prev.get("data_id") and data_id and prev["data_id"] != data_id:
        changed.append(f"the data in {cfg.features} (other features or conversations at the same path)")
    if changed:
        raise ChangedOutput(f"{run_dir} was trained with other settings ({'; '.join(changed)}): a resume continues "
                            "the same run; set them back, or choose another --out", run_dir)
    return ckpt, checkpoint_step(ckpt)


class Trainer:
    """One run as verbs on its components: built in __init__ (resumed when the run dir holds a
    checkpoint), then `step` per optimizer step, `save` per checkpoint, `fit` for the loop."""

    def __init__(self, cfg: TrainConfig, d: P.Dist, on_checkpoint: CheckpointCallback | None = None):
        self.cfg, self.d, self.on_checkpoint = cfg, d, on_checkpoint
        self.run_dir = Path(cfg.out)
        self.precision = P.resolve_precision(cfg.precision, d.device)
        self.done: dict[str, Any] | None = None  # set when the run dir already holds max_steps
        self.unmeasured = False  # the checkpoint resumed from was due for the callback and has no record
        self.data_id = data_identity(cfg)
        self.ckpt, step = resume_point(cfg, self.data_id)
        # train.max_minutes: what its budget fitted (kept in the manifest: a resume finishes that run)
        self.budget_info: dict[str, Any] = {}
        if self.ckpt is not None and cfg.max_minutes > 0:
            self.budget_info = (read_manifest(self.run_dir) or {}).get("budget") or {}
            self.cfg = cfg = dataclasses.replace(cfg, max_steps=resumed_max_steps(cfg.max_steps, cfg.max_minutes,
                                                                                 {"budget": self.budget_info}))
        if self.ckpt is not None and d.rank == 0:
            repair_latest(self.run_dir, self.ckpt)
            remove_temp_files(self.run_dir)  # a manifest write a kill cut short
        if self.ckpt is not None:
            self.unmeasured = self._unmeasured(step)
            if step >= cfg.max_steps and not self.unmeasured:
                if (read_manifest(self.run_dir) or {}).get("complete"):
                    _log(f"{self.run_dir} already holds {self.ckpt.name} (>= max_steps {cfg.max_steps}); nothing to do", d)
                    self.done = {"step": step, "checkpoint": str(self.ckpt), "skipped": True}
                    return
                _log(f"{self.ckpt.name} is the last step but the run was not marked complete (killed?): finishing it", d)
            if step < cfg.max_steps and not cfg.resume:
                raise ValueError(f"{self.run_dir} holds checkpoints up to {self.ckpt.name}: pass --resume to continue "
                                 "it, or choose another --out")
        self.target_dir = on_main(lambda: str(resolve_target(cfg.target).resolve()), d)
        tcfg = text_config(self.target_dir)
        self.src, self.data = open_data(cfg, self.target_dir, d.rank, device=str(d.device))
        try:
            self._build(tcfg)
        except BaseException:
            self.data.close()
            raise

    def _build(self, tcfg: Any) -> None:
        cfg, d, src = self.cfg, self.d, self.src
        if src.hidden_size != tcfg.hidden_size:
            raise ValueError(f"features hidden size {src.hidden_size} != target hidden size {tcfg.hidden_size}: "
                             "the features were made with another target")
        check_provenance(getattr(src, "manifest", None) or {}, cfg.features, self.target_dir)
        init = load_warm_start(cfg.init_from, self.target_dir, src.layer_ids) if cfg.init_from else None
        if init is not None and self.ckpt is None:
            _log(f"warm start from {cfg.init_from} (its draft vocab, {init.spec.draft_vocab_size} ids)", d)
        self.vocab = build_vocab(cfg, src, int(tcfg.vocab_size), d, init)
        _log(f"draft vocab {self.vocab.size} of {self.vocab.vocab_size}: covers {self.vocab.coverage:.1%} of "
             f"{self.vocab.num_tokens} loss tokens ({self.vocab.num_seen} distinct ids seen)", d)
        self.draft = build_draft(cfg, self.target_dir, tcfg, src.layer_ids, self.vocab, d.device, self.precision, d,
                                 init=init)
        spec = self.draft.spec
        self.draft_cfg = draft_config_dict(spec)
        self.draft_meta = {"draft_config": self.draft_cfg, "layer_ids": list(spec.layer_ids),
                           "draft_vocab": self.vocab.info(), "target": self.target_dir, "spec": spec_dict(spec),
                           "source": src.describe(), "precision": self.precision}
        self.start = self._resume() if self.ckpt is not None else 0
        self.logger = MetricsLogger(self.run_dir, d.is_main, resume_step=self.start)
        self._manifest(complete=False)
        _log(f"{d.world} rank(s) on {d.device.type} ({d.backend}), {self.precision}"
             f"{' (FSDP2)' if self.draft.sharded else ', bare module'}; draft "
             f"{sum(p.numel() for p in self.draft.trainable):,} trainable params; layers {list(spec.layer_ids)}; "
             f"steps {self.start}->{cfg.max_steps}", d)
        self.win = _Window(cfg.ttt_steps, d.device)
        self.last_rec: dict[str, Any] = {}
        self.last_ckpt, self.saved = self.ckpt, self.start
        self.micro_seen = 0  # micro-batches this run: every score_every-th is scored, and each log window's first
        self.tokens_run = 0

    def _lone_final(self, step: int, final: bool) -> bool:
        """A final checkpoint the callback skips: no earlier one was due (nothing to choose between)
        and `train.eval_lone_final` is off (its AL is measured later, as `eyas run`'s eval stage does)."""
        return final and not self.cfg.eval_lone_final and not 0 < self.cfg.eval_every < step

    def _compares(self, step: int, final: bool) -> bool:
        if not self._lone_final(step, final):
            return True
        _log(f"step {step}: the only checkpoint due for a serve-eval: not measured here (train.eval_lone_final "
             "is off; its true AL is measured after training)", self.d)
        return False

    def _unmeasured(self, step: int) -> bool:
        """The checkpoint at `step` was due for the callback and the callback has no record of it."""
        measured = getattr(self.on_checkpoint, "measured", None)
        final = step >= self.cfg.max_steps
        due = final or (self.cfg.eval_every > 0 and step % self.cfg.eval_every == 0)
        return bool(measured is not None and due and not measured(step) and not self._lone_final(step, final))

    def _resume(self) -> int:
        cfg, d, ckpt, dr = self.cfg, self.d, self.ckpt, self.draft
        st = load_checkpoint(ckpt, dr.model, dr.opt, d.rank, trust=cfg.trust_checkpoint)
        if st.get("draft_config") not in (None, self.draft_cfg):
            raise ValueError(f"cannot resume {ckpt}: it was trained with another draft config")
        if not torch.equal(dr.model.d2t.cpu(), self.vocab.d2t):
            raise ValueError(f"cannot resume {ckpt}: its draft vocab differs from this data's (different data?)")
        self.data.load_state_dict(st["data"])
        dr.sched.load_state_dict(st["schedule"])  # the saved schedule continues exactly ...
        if cfg.lr_decay_steps and cfg.lr_decay_steps != dr.sched.decay_steps:  # ... unless a new horizon is asked for
            _log(f"lr schedule: cosine horizon {dr.sched.decay_steps} -> {cfg.lr_decay_steps} (train.lr_decay_steps)", d)
            dr.sched.decay_steps = cfg.lr_decay_steps
        _log(f"resumed from {ckpt} at step {st['step']} (saved by {st.get('world_size')} rank(s), now {d.world}); "
             f"data position {self.data.state_dict()}", d)
        return int(st["step"])

    def _manifest(self, complete: bool, **extra: Any) -> None:
        if self.d.is_main:
            write_manifest(self.run_dir, "train", self.cfg, complete=complete, target=self.target_dir,
                           world_size=self.d.world, precision=self.precision, device=str(self.d.device),
                           fsdp=self.draft.sharded,
                           draft_config=self.draft_cfg, draft_vocab=self.vocab.info(), source=self.src.describe(),
                           start_step=self.start, data_id=self.data_id,
                           fitted_steps=self.budget_info.get("fitted_steps"), budget=self.budget_info or None, **extra)

    # ---- verbs
    def step(self, step: int) -> torch.Tensor | None:
        """One optimizer step (world x grad_accum micro-batches); None when the data ended on some rank."""
        cfg, d, dr, win = self.cfg, self.d, self.draft, self.win
        t0 = time.perf_counter()
        self.lr = dr.sched(step - 1)
        for g in dr.opt.param_groups:
            g["lr"] = self.lr
        mbs = self.data.next_step(d.world, cfg.grad_accum, d.rank)
        win.data_s += time.perf_counter() - t0
        if not _all_have(mbs is not None, d):  # a stream ended somewhere: every rank stops here
            return None
        loss = None
        for a, items in enumerate(mbs):
            td = time.perf_counter()
            batch = collate(items, cfg.max_len, cfg.loss_tokens).to(d.device)
            win.data_s += time.perf_counter() - td
            if dr.sharded:
                dr.model.set_requires_gradient_sync(a == len(mbs) - 1)
            score = win.micro == 0 or self.micro_seen % max(1, cfg.score_every) == 0
            self.micro_seen += 1
            with dr.compute():
                loss, stats = ttt_loss(dr.model, batch, dr.head, cfg.ttt_steps, cfg.position_decay, score=score,
                                       hard=cfg.hard_label, loss=cfg.loss, min_prob=cfg.min_target_prob)
            (loss / cfg.grad_accum).backward()
            win.add(loss.detach(), stats, batch.num_tokens)
        gnorm = torch.nn.utils.clip_grad_norm_(dr.trainable, cfg.grad_clip)
        gnorm = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm
        dr.opt.step()
        dr.opt.zero_grad(set_to_none=True)
        win.grad_norm += float(gnorm)
        win.steps += 1
        win.step_s += time.perf_counter() - t0
        return loss

    def log(self, step: int, bar: Any = None) -> None:
        rec = self.win.reduce(step, self.lr)
        self.tokens_run += rec["tokens"]
        self.logger.log(rec, echo=bar is None)
        if bar is not None:
            bar.write(format_line(rec))
        self.last_rec, self.win = rec, _Window(self.cfg.ttt_steps, self.d.device)

    def save(self, step: int, evaluate: bool, final: bool = False) -> Path:
        """Checkpoint (every rank); then, when `evaluate`, the checkpoint callback on rank 0 (not for the
        final checkpoint when no earlier one was measured and `train.eval_lone_final` is off)."""
        dr = self.draft
        trainer_state = {"data": self.data.state_dict(), "schedule": dr.sched.state_dict(),
                         "draft_config": self.draft_cfg, "config": dataclasses.asdict(self.cfg)}
        self.last_ckpt = save_checkpoint(self.run_dir, step, dr.model, dr.opt, trainer_state, self.draft_meta,
                                         self.d.rank, self.d.world)
        self.saved = step
        _log(f"saved {self.last_ckpt}", self.d)
        if evaluate:
            estimates = {"est_al": self.last_rec.get("est_al"), **self.simulate(step)}
            if self.on_checkpoint is not None and self._compares(step, final):
                self._evaluate(self.last_ckpt, step, estimates)
        return self.last_ckpt

    def simulate(self, step: int) -> dict[str, Any]:
        """Simulated AL (eyas.draft.simulate, k = ttt_steps) on the held-out samples; every rank runs
        the same forwards (FSDP gathers collectively), rank 0 logs. {} without `train.holdout`."""
        if not getattr(self.src, "heldout", None):
            return {}
        if not hasattr(self, "_heldout"):
            self._heldout = self.src.heldout_samples()
        k = self.cfg.ttt_steps
        with self.draft.compute():
            counts = simulate_samples(self.draft.model, self._heldout, k, self.cfg.max_len, self.d.device)
        rates = summarize_acceptance(counts, k)
        out = {"sim_al": rates["acceptance_length"] or 1.0, "sim_per_pos": rates["per_pos"] or [0.0] * k,
               "sim_drafts": counts["num_drafts"]}
        self.logger.log({"step": step, **out}, echo=False)
        _log(f"simulated AL {out['sim_al']:.3f} (k={k}) per pos {[round(x, 3) for x in out['sim_per_pos']]} on "
             f"{len(self._heldout)} held-out samples", self.d)
        return out

    def _evaluate(self, ckpt: Path, step: int, estimates: dict[str, Any]) -> None:
        def run() -> None:
            rec = self.on_checkpoint(ckpt, step, estimates)
            if rec:
                _log(f"checkpoint callback, step {step}: {json.dumps(rec)[:400]}")
                al = rec.get("acceptance_length")
                if isinstance(al, (int, float)) and self.logger.tb is not None:
                    self.logger.tb.add_scalar("serve/acceptance_length", al, step)

        try:
            on_main(run, self.d)
        except Exception as e:  # every rank raises (on_main), with the checkpoint named
            raise RuntimeError(f"evaluating {ckpt} failed: {type(e).__name__}: {e}") from e

    def fit(self) -> dict[str, Any]:
        """Steps start+1 .. max_steps (or until the data ends): log, checkpoint, evaluate."""
        cfg, d = self.cfg, self.d
        bar = None
        if d.is_main and cfg.progress:
            from tqdm import tqdm

            bar = tqdm(total=cfg.max_steps, initial=self.start, unit="step", dynamic_ncols=True, file=sys.stderr)
        done = self.start
        if self.unmeasured:
            _log(f"{self.ckpt.name} was due for evaluation and has no record (interrupted?): evaluating it now", d)
            self._evaluate(self.ckpt, self.start, {"est_al": self.logger.last("est_al"), **self.simulate(self.start)})
        t_run = time.perf_counter()
        self.lr = self.draft.sched(self.start)
        fitted = "fitted_steps" in self.budget_info
        budget = StepBudget(cfg.max_minutes * 60, cfg.max_steps) if cfg.max_minutes > 0 and not fitted else None
        step, self.steps_s = self.start, 0.0  # seconds in optimizer steps (saves and serve-evals apart)
        while step < self.cfg.max_steps:
            step += 1
            t_step = time.perf_counter()
            loss = self.step(step)
            if loss is None:
                _log(f"the data stream ended after {done} steps", d)
                break
            done = step
            dt = time.perf_counter() - t_step
            self.steps_s += dt
            if budget is not None:
                budget.add(dt)
                if budget.due():
                    self._fit_budget(budget, step, bar)
                    budget = None
                cfg = self.cfg
            failpoint("train.step")
            final = step == cfg.max_steps
            if step % max(1, cfg.log_every) == 0 or final:
                self.log(step, bar)
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"loss {float(loss.detach()):.3f} {self.last_rec.get('tokens_per_s', 0):.0f} tok/s")
            eval_due = final or (cfg.eval_every > 0 and step % cfg.eval_every == 0)
            if eval_due or (cfg.save_every > 0 and step % cfg.save_every == 0):
                self.save(step, evaluate=eval_due, final=final)
        if done > self.saved:  # the stream ended early: finish like the last step
            if self.win.steps:
                self.log(done, bar)
            self.save(done, evaluate=True, final=True)
        if bar is not None:
            bar.close()
        elapsed = time.perf_counter() - t_run
        summary = {"step": done, "steps_run": done - self.start, "checkpoint": str(self.last_ckpt),
                   "last": self.last_rec, "elapsed_s": elapsed, "steps_s": self.steps_s,
                   **({"budget": self.budget_info} if self.budget_info else {}),
                   "tokens": self.tokens_run, "tokens_per_s": self.tokens_run / max(elapsed, 1e-9)}
        self._manifest(complete=True, final=summary)
        return summary

    def _fit_budget(self, budget: StepBudget, step: int, bar: Any) -> None:
        """train.max_minutes: the run's step count from its pace so far; every rank takes the slowest's."""
        per_step = budget.per_step()
        if self.d.world > 1:  # every rank must stop at the same step
            t = torch.tensor([per_step], dtype=torch.float64, device=self.d.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            per_step = float(t.item())
        asked = self.cfg.max_steps
        n = budget.fit(step, asked, per_step)
        self.cfg = dataclasses.replace(self.cfg, max_steps=n)
        if not self.cfg.lr_decay_steps:
            self.draft.sched.decay_steps = max(1, n)
        self.budget_info = {"minutes": self.cfg.max_minutes, "per_step_s": round(per_step, 4),
                            "timed_steps": len(budget.times) - budget.skip, "max_steps": asked, "fitted_steps": n}
        if bar is not None:
            bar.total = n
            bar.refresh()
        _log(f"budget {self.cfg.max_minutes:g} min at {per_step:.3f} s/step (the mean of steps "
             f"{step - len(budget.times) + budget.skip + 1}-{step}): {n} steps of the {asked} asked"
             + ("" if self.cfg.lr_decay_steps else f"; cosine horizon {n}"), self.d)
        self._manifest(complete=False)

    def close(self) -> None:
        self.logger.close()
        self.data.close()


def _all_have(flag: bool, d: P.Dist) -> bool:
    t = torch.tensor([1 if flag else 0], device=d.device)
    if d.world > 1:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return bool(t.item())


class _Window:
    """Per-rank sums since the last log; `reduce` sums over ranks and divides once."""

    def __init__(self, K: int, device: torch.device):
        self.stats = torch.zeros(len(STAT_ORDER), K, dtype=torch.float64, device=device)
        self.loss = torch.zeros((), dtype=torch.float64, device=device)
        self.micro = 0
        self.tokens = 0
        self.steps = 0
        self.grad_norm = 0.0
        self.data_s = 0.0
        self.step_s = 0.0
        self.t0 = time.perf_counter()

    def add(self, loss: torch.Tensor, stats: dict[str, torch.Tensor], tokens: int) -> None:
        self.loss += loss.double()
        self.stats += torch.stack([stats[k] for k in STAT_ORDER])
        self.micro += 1
        self.tokens += tokens

    def reduce(self, step: int, lr: float) -> dict[str, Any]:
        K = self.stats.shape[1]
        head = torch.tensor([float(self.loss), self.micro, self.tokens, self.data_s, self.step_s],
                            dtype=torch.float64, device=self.stats.device)
        vec = P.all_reduce_sum(torch.cat([head, self.stats.flatten()]))
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        loss_sum, micro, tokens, data_s, step_s = vec[:5].tolist()
        stats = dict(zip(STAT_ORDER, vec[5:].view(len(STAT_ORDER), K)))
        wall = time.perf_counter() - self.t0
        return {
            "step": step,
            "loss": loss_sum / max(micro, 1),
            **summarize(stats),
            "lr": lr,
            "grad_norm": self.grad_norm / max(self.steps, 1),
            "tokens": int(tokens),
            "tokens_per_s": tokens / max(wall, 1e-9),
            "step_s": step_s / world / max(self.steps, 1),
            "data_s": data_s / world / max(self.steps, 1),
            "micro_batches": int(micro),
        }
