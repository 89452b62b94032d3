"""Training throughput: tokens/s of the recipe's draft on a target, and where the time goes.

One process, no process group (the bare module, bf16 through autocast, as the trainer runs a
world of one): the trainer's own `build_draft` (draft, AdamW, frozen target head),
timed piece by piece per micro-batch: data (read + collate), target lm_head (soft labels,
and the full-vocab top-1 on every `score_every`-th micro-batch as the trainer scores them,
`TargetHead(timed=True)`), draft forward (TTT unroll + loss),
backward, optimizer (clip + AdamW). The draft's settings are the recipe's `train`
section (TTT steps, draft vocab, token budget, lr). Data comes from a feature dir when
given, else random states of the target's shapes (data time is then ~0).
`eyas bench train` calls `run_bench`.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from eyas.bench.roofline import count_flops, fraction_line, peak_flops, roofline_fields
from eyas.draft.ttt import Batch, ttt_loss
from eyas.draft.vocab import build_draft_vocab, top_n_vocab
from eyas.models import resolve_target
from eyas.target import default_layer_ids, text_config
from eyas.train.data import GlobalBatches, OfflineSource, collate
from eyas.train.loop import build_draft
from eyas.train.parallel import resolve_precision


def _synthetic(T: int, B: int, n_aux: int, H: int, V: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) < 0.7
    aux = (torch.randn(B, T, n_aux * H, generator=g)).to(torch.bfloat16)
    last = torch.randn(B, T, H, generator=g).to(torch.bfloat16)
    return Batch(ids, mask, aux, last, num_tokens=B * T)


def run_bench(target: str, train_cfg: Any, features: str = "", steps: int = 5, warmup: int = 1, seq_len: int = 1024,
              device: str = "") -> dict[str, Any]:
    """Print and return tokens/s and seconds per micro-batch for each part (`train_cfg`: a TrainConfig)."""
    cfg = train_cfg
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    tdir = resolve_target(target)
    tcfg = text_config(tdir)
    V, H = int(tcfg.vocab_size), int(tcfg.hidden_size)
    src = None
    if features:
        src = OfflineSource(features, max_len=seq_len)
        layer_ids = src.layer_ids
        vocab = build_draft_vocab(src.ids_masks(), min(cfg.draft_vocab_size, V), V)
        order = GlobalBatches(src.lengths, cfg.token_budget, seed=0)
    else:
        layer_ids = cfg.layer_ids or default_layer_ids(int(tcfg.num_hidden_layers))
        vocab = top_n_vocab(torch.arange(V, 0, -1), min(cfg.draft_vocab_size, V))
    precision = resolve_precision(cfg.precision, dev)  # the trainer's rule (bf16 where the device has fast bf16)
    dr = build_draft(cfg, str(tdir), tcfg, layer_ids, vocab, dev, precision, timed_head=True)
    dr.model.train()
    parts = {"data_s": 0.0, "target_head_s": 0.0, "draft_fwd_s": 0.0, "draft_bwd_s": 0.0, "optim_s": 0.0}
    tokens = loss_tokens = 0
    B = max(1, cfg.token_budget // seq_len)
    every = max(1, cfg.score_every)
    for it in range(warmup + steps):
        t0 = time.perf_counter()
        if src is not None:
            batch = collate(src.load(order.take(1)[0]), seq_len, cfg.loss_tokens)  # the trainer's loss rows
        else:
            batch = _synthetic(seq_len, B, dr.spec.n_aux, H, V, it)
        batch = batch.to(dev)
        sync()
        t1 = time.perf_counter()
        dr.head.seconds = 0.0
        with dr.compute():  # the trainer's own context (bf16 autocast where it trains in bf16)
            loss, st = ttt_loss(dr.model, batch, dr.head, cfg.ttt_steps, cfg.position_decay,
                                score=it % every == 0)
        sync()
        t2 = time.perf_counter()
        loss.backward()
        sync()
        t3 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(dr.trainable, cfg.grad_clip)
        dr.opt.step()
        dr.opt.zero_grad(set_to_none=True)
        sync()
        t4 = time.perf_counter()
        if it < warmup:
            continue
        parts["data_s"] += t1 - t0
        parts["target_head_s"] += dr.head.seconds
        parts["draft_fwd_s"] += t2 - t1 - dr.head.seconds
        parts["draft_bwd_s"] += t3 - t2
        parts["optim_s"] += t4 - t3
        tokens += batch.num_tokens
        loss_tokens += int(st["rows"][0])
    total = sum(parts.values())

    def fwd_bwd(score: bool) -> None:  # one more micro-batch (the last one again), counted
        with dr.compute():  # the trainer's own context (bf16 autocast where it trains in bf16)
            loss, _ = ttt_loss(dr.model, batch, dr.head, cfg.ttt_steps, cfg.position_decay, score=score)
        loss.backward()

    # one scored micro-batch in every `score_every`
    flops = (count_flops(lambda: fwd_bwd(True)) + (every - 1) * count_flops(lambda: fwd_bwd(False))) / every
    flops_per_token = flops / batch.num_tokens
    dr.opt.zero_grad(set_to_none=True)
    peak = peak_flops("bfloat16" if precision == "bf16" else "float32", torch.get_num_threads())
    res = {k: v / steps for k, v in parts.items()}
    res.update(target=str(tdir), device=str(dev), precision=precision, threads=torch.get_num_threads(),
               draft_vocab_size=vocab.size, ttt_steps=cfg.ttt_steps, tokens_per_micro_batch=tokens / steps,
               loss_tokens_per_micro_batch=loss_tokens / steps, tokens_per_s=tokens / max(total, 1e-9),
               score_every=every, params=sum(p.numel() for p in dr.trainable), source="features" if src is not None else "synthetic")
    res.update(roofline_fields(res["tokens_per_s"], flops_per_token, peak))
    print(f"eyas bench train: {res['tokens_per_s']:.0f} tokens/s ({res['device']}, {precision}, "
          f"{res['threads']} threads, {res['tokens_per_micro_batch']:.0f} tokens/micro-batch, K={cfg.ttt_steps}, "
          f"Vd={vocab.size}, {res['params'] / 1e6:.1f}M trainable params, {res['source']} data)")
    for k in parts:
        print(f"  {k[:-2]:<12} {res[k] * 1e3:9.1f} ms/micro-batch  {100 * parts[k] / max(total, 1e-9):5.1f}%")
    print("  " + fraction_line("roofline", res["tokens_per_s"], flops_per_token, peak)
          + " (matmul FLOPs of forward and backward, counted by torch's FlopCounterMode; the optimizer's not counted)")
    return res
