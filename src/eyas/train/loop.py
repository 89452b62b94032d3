"""The training loop: build everything, resume, step, log, checkpoint, serve-eval.

One optimizer step = world x grad_accum micro-batches of the global order (see
`eyas.train.data`); each micro-batch loss is the TTT loss (a mean over its loss tokens),
divided by grad_accum; FSDP2 averages over ranks. So a step's gradient is the mean over
its micro-batches whatever the split between ranks and accumulation.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from eyas.config import TrainConfig
from eyas.draft.ttt import STAT_KEYS as STAT_ORDER
from eyas.train import parallel as P
from eyas.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from eyas.train.data import LOSS_TOKENS
from eyas.train.metrics import MetricsLogger, format_line, summarize


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


def check_config(cfg: TrainConfig) -> None:
    if not cfg.out:
        raise ValueError("no run dir: pass --out RUN")
    if not cfg.target:
        raise ValueError("no target: pass --target NAME|DIR")
    if cfg.max_steps < 1 or cfg.ttt_steps < 1 or cfg.grad_accum < 1:
        raise ValueError("max_steps, ttt_steps and grad_accum must be >= 1")
    if cfg.token_budget < 8 or cfg.max_len < 8:
        raise ValueError("token_budget and max_len must be >= 8")
    if not 0 < cfg.position_decay <= 1:
        raise ValueError(f"position_decay must be in (0, 1], got {cfg.position_decay}")
    if cfg.loss_tokens not in LOSS_TOKENS:
        raise ValueError(f"unknown train.loss_tokens {cfg.loss_tokens!r}: {' | '.join(LOSS_TOKENS)}")
    if cfg.source not in ("offline", "online", "streaming"):
        raise ValueError(f"unknown train.source {cfg.source!r}: offline | online | streaming")


def build_vocab(cfg: TrainConfig, src, vocab_size: int, d: P.Dist):
    """Rank 0 counts (or hits the content-keyed cache); every rank gets the same ids."""
    from eyas.draft.vocab import DraftVocab, build_draft_vocab
    from eyas.models import eyas_home

    size = min(cfg.draft_vocab_size, vocab_size)

    def count():
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
    out, msg = P.broadcast_object((out, None if err is None else (type(err).__name__, str(err))), d)
    if err is not None:
        raise err
    if msg is not None:
        raise (ValueError if msg[0] == "ValueError" else RuntimeError)(f"on rank 0: {msg[1]}")
    return out


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run (or resume) training; returns the final summary. Works under torchrun or alone."""
    check_config(cfg)
    d = P.init_distributed()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _train(cfg, d)
    finally:
        P.destroy(d)


def _train(cfg: TrainConfig, d: P.Dist) -> dict[str, Any]:
    from transformers import AutoConfig

    from eyas.models import resolve_target
    from eyas.train.data import open_data

    run_dir = Path(cfg.out)
    precision = P.resolve_precision(cfg.precision, d.device)
    # ---- resume or not
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None:
        done = json.loads((ckpt / "trainer.json").read_text())["step"]
        if done >= cfg.max_steps:
            _log(f"{run_dir} already holds {ckpt.name} (>= max_steps {cfg.max_steps}); nothing to do", d)
            return {"step": done, "checkpoint": str(ckpt), "skipped": True}
        if not cfg.resume:
            raise ValueError(f"{run_dir} holds checkpoints up to {ckpt.name}: pass --resume to continue it, "
                             "or choose another --out")
    # ---- target, data, vocab
    target_dir = on_main(lambda: str(resolve_target(cfg.target).resolve()), d)
    tcfg = AutoConfig.from_pretrained(target_dir)
    tcfg = tcfg.get_text_config() if hasattr(tcfg, "get_text_config") else tcfg
    src, data = open_data(cfg, target_dir, d.rank, device=str(d.device))
    try:
        return _train_with(cfg, d, run_dir, precision, ckpt, target_dir, tcfg, src, data)
    finally:
        data.close()


def _train_with(cfg, d, run_dir, precision, ckpt, target_dir, tcfg, src, data) -> dict[str, Any]:
    from eyas.draft.model import DraftSpec, Eagle3Draft, draft_config_dict, spec_dict
    from eyas.draft.ttt import TargetHead, load_target_head, ttt_loss
    from eyas.manifest import write_manifest
    from eyas.train.data import collate

    if src.hidden_size != tcfg.hidden_size:
        raise ValueError(f"features hidden size {src.hidden_size} != target hidden size {tcfg.hidden_size}: "
                         "the features were made with another target")
    vocab = build_vocab(cfg, src, int(tcfg.vocab_size), d)
    _log(f"draft vocab {vocab.size} of {vocab.vocab_size}: covers {vocab.coverage:.1%} of "
         f"{vocab.num_tokens} loss tokens ({vocab.num_seen} distinct ids seen)", d)
    # ---- model, optimizer, schedule
    spec = DraftSpec.from_target_config(tcfg, src.layer_ids, vocab.size, fc_norm=cfg.fc_norm)
    embed, lm_head, tcfg_d = load_target_head(target_dir)
    model = Eagle3Draft(spec, freeze_embed=cfg.freeze_embed)
    model.init_weights(embed.float(), seed=cfg.seed)
    model.set_vocab(vocab.d2t, vocab.t2d)
    model.to(d.device)
    P.apply_fsdp(model, d, precision)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay)
    sched = WarmupCosine(cfg.lr, cfg.warmup_steps, cfg.lr_decay_steps or cfg.max_steps, cfg.min_lr_ratio)
    head_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    head = TargetHead(lm_head, vocab.draft_ids, softcap=tcfg_d.get("final_logit_softcapping"),
                      logit_scale=float(tcfg_d.get("logit_scale") or 1.0)).to(d.device, head_dtype)
    del embed, lm_head
    draft_cfg = draft_config_dict(spec)
    draft_meta = {"draft_config": draft_cfg, "layer_ids": list(spec.layer_ids), "draft_vocab": vocab.info(),
                  "target": target_dir, "spec": spec_dict(spec), "source": src.describe(), "precision": precision}
    start = 0
    if ckpt is not None:
        st = load_checkpoint(ckpt, model, opt, d.rank)
        start = int(st["step"])
        if st.get("draft_config") not in (None, draft_cfg):
            raise ValueError(f"cannot resume {ckpt}: it was trained with another draft config")
        if not torch.equal(model.d2t.cpu(), vocab.d2t):
            raise ValueError(f"cannot resume {ckpt}: its draft vocab differs from this data's (different data?)")
        data.load_state_dict(st["data"])
        sched.load_state_dict(st["schedule"])  # the saved schedule continues exactly ...
        if cfg.lr_decay_steps and cfg.lr_decay_steps != sched.decay_steps:  # ... unless a new horizon is asked for
            _log(f"lr schedule: cosine horizon {sched.decay_steps} -> {cfg.lr_decay_steps} (train.lr_decay_steps)", d)
            sched.decay_steps = cfg.lr_decay_steps
        _log(f"resumed from {ckpt} at step {start} (saved by {st.get('world_size')} rank(s), now {d.world}); "
             f"data position {data.state_dict()}", d)
    logger = MetricsLogger(run_dir, d.is_main, resume_step=start)
    if d.is_main:
        write_manifest(run_dir, "train", cfg, complete=False, target=target_dir, world_size=d.world,
                       precision=precision, device=str(d.device), draft_config=draft_cfg, draft_vocab=vocab.info(),
                       source=src.describe(), start_step=start)
    _log(f"{d.world} rank(s) on {d.device.type} ({d.backend}), {precision}; draft {sum(p.numel() for p in trainable):,} "
         f"trainable params; layers {list(spec.layer_ids)}; steps {start}->{cfg.max_steps}", d)

    # ---- loop
    bar = None
    if d.is_main and cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.max_steps, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr)
    K = cfg.ttt_steps
    win = _Window(K, d.device)
    last_rec: dict[str, Any] = {}
    last_ckpt, done, saved = ckpt, start, start
    t_run = time.perf_counter()
    tokens_run = 0
    micro_seen = 0  # micro-batches this run: every score_every-th is scored, and each log window's first
    lr = sched(start)

    def log(step: int) -> None:
        nonlocal win, last_rec, tokens_run
        rec = win.reduce(step, lr)
        tokens_run += rec["tokens"]
        logger.log(rec, echo=bar is None)
        if bar is not None:
            bar.write(format_line(rec))
        last_rec, win = rec, _Window(K, d.device)

    def save(step: int, evaluate: bool) -> None:
        nonlocal last_ckpt, saved
        trainer_state = {"data": data.state_dict(), "schedule": sched.state_dict(), "draft_config": draft_cfg,
                         "config": dataclasses.asdict(cfg)}
        last_ckpt = save_checkpoint(run_dir, step, model, opt, trainer_state, draft_meta, d.rank, d.world)
        saved = step
        _log(f"saved {last_ckpt}", d)
        if evaluate:
            _serve_eval(run_dir, last_ckpt, step, cfg, last_rec.get("est_al", 0.0), d, logger)

    for step in range(start + 1, cfg.max_steps + 1):
        t0 = time.perf_counter()
        lr = sched(step - 1)
        for g in opt.param_groups:
            g["lr"] = lr
        mbs = data.next_step(d.world, cfg.grad_accum, d.rank)
        win.data_s += time.perf_counter() - t0
        if not _all_have(mbs is not None, d):  # a stream ended somewhere: every rank stops here
            _log(f"the data stream ended after {done} steps", d)
            break
        for a, items in enumerate(mbs):
            td = time.perf_counter()
            batch = collate(items, cfg.max_len, cfg.loss_tokens).to(d.device)
            win.data_s += time.perf_counter() - td
            model.set_requires_gradient_sync(a == len(mbs) - 1)
            score = win.micro == 0 or micro_seen % max(1, cfg.score_every) == 0
            micro_seen += 1
            loss, stats = ttt_loss(model, batch, head, K, cfg.position_decay, score=score)
            (loss / cfg.grad_accum).backward()
            win.add(loss.detach(), stats, batch.num_tokens)
        gnorm = torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip)
        gnorm = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm
        opt.step()
        opt.zero_grad(set_to_none=True)
        win.grad_norm += float(gnorm)
        win.steps += 1
        win.step_s += time.perf_counter() - t0
        done = step
        final = step == cfg.max_steps
        if step % max(1, cfg.log_every) == 0 or final:
            log(step)
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"loss {float(loss.detach()):.3f} {last_rec.get('tokens_per_s', 0):.0f} tok/s")
        eval_due = final or (cfg.eval_every > 0 and step % cfg.eval_every == 0)
        if eval_due or (cfg.save_every > 0 and step % cfg.save_every == 0):
            save(step, evaluate=eval_due)
    if done > saved:  # the stream ended early: finish like the last step
        if win.steps:
            log(done)
        save(done, evaluate=True)
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - t_run
    summary = {"step": done, "checkpoint": str(last_ckpt), "last": last_rec, "elapsed_s": elapsed,
               "tokens": tokens_run, "tokens_per_s": tokens_run / max(elapsed, 1e-9)}
    if d.is_main:
        write_manifest(run_dir, "train", cfg, complete=True, target=target_dir, world_size=d.world,
                       precision=precision, device=str(d.device), draft_config=draft_cfg, draft_vocab=vocab.info(),
                       source=src.describe(), start_step=start, final=summary)
    logger.close()
    return summary


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


def _serve_eval(run_dir: Path, ckpt: Path, step: int, cfg: TrainConfig, est_al: float, d: P.Dist,
                logger: MetricsLogger) -> None:
    """Rank 0 runs `eyas.serve_eval.on_checkpoint` (if that module exists); the others wait."""

    def run() -> None:
        try:
            se = importlib.import_module("eyas.serve_eval")
        except ModuleNotFoundError as e:
            if e.name != "eyas.serve_eval":
                raise
            _log("eyas.serve_eval is not available; skipping the vLLM acceptance check")
            return
        rec = se.on_checkpoint(run_dir, ckpt, step, cfg, est_al)
        if rec:
            _log(f"serve-eval step {step}: {json.dumps(rec)[:400]}")
            al = rec.get("acceptance_length")
            if isinstance(al, (int, float)) and logger.tb is not None:
                logger.tb.add_scalar("serve/acceptance_length", al, step)

    try:
        on_main(run, d)
    except Exception as e:  # every rank raises (on_main), with the checkpoint named
        raise RuntimeError(f"serve-eval of {ckpt} failed: {type(e).__name__}: {e}") from e
