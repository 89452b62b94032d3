"""Training throughput: tokens/s of the default draft on a target, and where the time goes.

One process, no process group (bf16 through autocast where the trainer would use FSDP2's
mixed precision): the draft, its optimizer and the frozen target lm_head,
timed piece by piece per micro-batch: data (read + collate), target lm_head (soft labels
and full-vocab top-1), draft forward (TTT unroll + loss), backward, optimizer (clip + AdamW).
Data comes from a feature dir when given, else random states of the target's shapes
(data time is then ~0). `eyas bench train` calls `run_bench`.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def _synthetic(T: int, B: int, n_aux: int, H: int, V: int, seed: int):
    from eyas.draft.ttt import Batch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) < 0.7
    aux = (torch.randn(B, T, n_aux * H, generator=g)).to(torch.bfloat16)
    last = torch.randn(B, T, H, generator=g).to(torch.bfloat16)
    return Batch(ids, mask, aux, last, num_tokens=B * T)


def run_bench(
    target: str = "smollm2-135m-instruct",
    features: str = "",
    steps: int = 5,
    warmup: int = 1,
    token_budget: int = 4096,
    seq_len: int = 1024,
    draft_vocab_size: int = 8192,
    ttt_steps: int = 7,
    threads: int = 0,
    device: str = "",
    precision: str = "auto",
) -> dict[str, Any]:
    """Print and return tokens/s and seconds per micro-batch for each part."""
    from transformers import AutoConfig

    from eyas.config import TrainConfig
    from eyas.draft.model import DraftSpec, Eagle3Draft
    from eyas.draft.ttt import TargetHead, load_target_head, ttt_loss
    from eyas.draft.vocab import build_draft_vocab, top_n_vocab
    from eyas.extract import default_layer_ids
    from eyas.models import resolve_target
    from eyas.train.parallel import resolve_precision

    if threads:
        torch.set_num_threads(threads)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    tdir = resolve_target(target)
    tcfg = AutoConfig.from_pretrained(tdir)
    tcfg = tcfg.get_text_config() if hasattr(tcfg, "get_text_config") else tcfg
    V, H = int(tcfg.vocab_size), int(tcfg.hidden_size)
    src = None
    if features:
        from eyas.train.data import GlobalBatches, OfflineSource, collate

        src = OfflineSource(features, max_len=seq_len)
        layer_ids = src.layer_ids
        vocab = build_draft_vocab(src.ids_masks(), min(draft_vocab_size, V), V)
        order = GlobalBatches(src.lengths, token_budget, seed=0)
    else:
        layer_ids = default_layer_ids(int(tcfg.num_hidden_layers))
        vocab = top_n_vocab(torch.arange(V, 0, -1), min(draft_vocab_size, V))
    spec = DraftSpec.from_target_config(tcfg, layer_ids, vocab.size)
    embed, lm_head, _ = load_target_head(tdir)
    model = Eagle3Draft(spec)
    model.init_weights(embed.float())
    model.set_vocab(vocab.d2t, vocab.t2d)
    model.to(dev).train()
    precision = resolve_precision(precision, dev)  # the trainer's rule (bf16 where the device has fast bf16)
    head = TargetHead(lm_head, vocab.draft_ids).to(dev, torch.bfloat16 if precision == "bf16" else torch.float32)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=TrainConfig.lr)
    t_head = [0.0]
    labels = head.labels

    def timed_labels(last, top1=True):
        sync()
        t0 = time.perf_counter()
        out = labels(last, top1)
        sync()
        t_head[0] += time.perf_counter() - t0
        return out

    head.labels = timed_labels  # type: ignore[method-assign]
    parts = {"data_s": 0.0, "target_head_s": 0.0, "draft_fwd_s": 0.0, "draft_bwd_s": 0.0, "optim_s": 0.0}
    tokens = loss_tokens = 0
    B = max(1, token_budget // seq_len)
    for it in range(warmup + steps):
        t0 = time.perf_counter()
        if src is not None:
            batch = collate(src.load(order.take(1)[0]), seq_len)
        else:
            batch = _synthetic(seq_len, B, spec.n_aux, H, V, it)
        batch = batch.to(dev)
        sync()
        t1 = time.perf_counter()
        t_head[0] = 0.0
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss, st = ttt_loss(model, batch, head, ttt_steps, 0.8)
        sync()
        t2 = time.perf_counter()
        loss.backward()
        sync()
        t3 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(trainable, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t4 = time.perf_counter()
        if it < warmup:
            continue
        parts["data_s"] += t1 - t0
        parts["target_head_s"] += t_head[0]
        parts["draft_fwd_s"] += t2 - t1 - t_head[0]
        parts["draft_bwd_s"] += t3 - t2
        parts["optim_s"] += t4 - t3
        tokens += batch.num_tokens
        loss_tokens += int(st["rows"][0])
    total = sum(parts.values())
    res = {k: v / steps for k, v in parts.items()}
    res.update(target=str(tdir), device=str(dev), precision=precision, threads=torch.get_num_threads(),
               draft_vocab_size=vocab.size, ttt_steps=ttt_steps, tokens_per_micro_batch=tokens / steps,
               loss_tokens_per_micro_batch=loss_tokens / steps, tokens_per_s=tokens / max(total, 1e-9),
               params=sum(p.numel() for p in trainable), source="features" if src is not None else "synthetic")
    print(f"eyas bench train: {res['tokens_per_s']:.0f} tokens/s ({res['device']}, {precision}, "
          f"{res['threads']} threads, {res['tokens_per_micro_batch']:.0f} tokens/micro-batch, K={ttt_steps}, "
          f"Vd={vocab.size}, {res['params'] / 1e6:.1f}M trainable params, {res['source']} data)")
    for k in parts:
        print(f"  {k[:-2]:<12} {res[k] * 1e3:9.1f} ms/micro-batch  {100 * parts[k] / max(total, 1e-9):5.1f}%")
    return res
