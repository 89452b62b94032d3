"""Training data: sources of per-token target states, token-budget micro-batches, a global position.

Sources (`train.source`) all yield the extraction dict
`{id, input_ids [T], loss_mask [T], aux_hidden_states [T, n, H], last_hidden_states [T, H]}`:

- offline:   a feature dir (`eyas.features.open_features`), random access;
- online:    conversations JSONL (or pre-tokenized `input_ids`/`loss_mask` JSONL); the frozen
             target runs per micro-batch (`eyas.extract.make_extractor(..., "hf")`);
- streaming: samples pushed by `eyas extract --mode streaming` producers to this rank's
             consumer (`eyas.extract.stream.open_consumer`), batched in arrival order.

For the indexed sources the micro-batch plan of an epoch depends only on (lengths,
token budget, seed, epoch) (`eyas.packing.plan_epoch`: the global
order). An optimizer step consumes world x grad_accum consecutive micro-batches of that
global order; rank r takes micro-batches base + a*world + r. The position saved in a
checkpoint is global (epoch, index), so a run resumes on any number of ranks without
repeating or skipping data, and 1 rank x accum 2 sees exactly what 2 ranks x accum 1 see.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eyas.config import TrainConfig, choices
from eyas.draft.ttt import Batch
from eyas.features import open_features
from eyas.io import iter_jsonl, open_safetensors
from eyas.packing import pack_by_length, plan_epoch

# ---------------------------------------------------------------------------------------------
# collate


LOSS_TOKENS = choices(TrainConfig, "loss_tokens")


def collate(items: list[dict[str, Any]], max_len: int, loss_tokens: str = "assistant") -> Batch:
    """Right-pad samples (truncated to max_len) into a Batch; aux flattened to [B, T, n*H].

    loss_tokens "assistant" keeps each sample's loss mask; "all" trains on every real token
    (prompts too: their labels are still the target's own distributions)."""
    if loss_tokens not in LOSS_TOKENS:
        raise ValueError(f"train.loss_tokens must be one of {LOSS_TOKENS}, got {loss_tokens!r}")
    assert items
    lens = [min(int(it["input_ids"].shape[0]), max_len) for it in items]
    B, T = len(items), max(lens)
    n, H = items[0]["aux_hidden_states"].shape[1:]
    dt = items[0]["aux_hidden_states"].dtype
    ids = torch.zeros(B, T, dtype=torch.int64)
    mask = torch.zeros(B, T, dtype=torch.bool)
    aux = torch.zeros(B, T, n * H, dtype=dt)
    last = torch.zeros(B, T, items[0]["last_hidden_states"].shape[-1], dtype=dt)
    for b, (it, L) in enumerate(zip(items, lens)):
        ids[b, :L] = torch.as_tensor(it["input_ids"][:L], dtype=torch.int64)
        mask[b, :L] = True if loss_tokens == "all" else torch.as_tensor(it["loss_mask"][:L]).to(torch.bool)
        aux[b, :L] = it["aux_hidden_states"][:L].reshape(L, n * H).to(dt)
        last[b, :L] = it["last_hidden_states"][:L].to(dt)
    return Batch(ids, mask, aux, last, num_tokens=sum(lens))


# ---------------------------------------------------------------------------------------------
# sources


class OfflineSource:
    """A feature dir written by `eyas extract`."""

    kind = "offline"

    def __init__(self, path: str | os.PathLike, max_len: int, holdout: int = 0, max_samples: int = 0):
        self.ds = open_features(path)
        self.path = Path(path)
        self.layer_ids: list[int] = list(self.ds.layer_ids)
        self.hidden_size: int = int(self.ds.hidden_size)
        self.max_len = max_len
        n = len(self.ds)
        if not 0 <= holdout < n:
            raise ValueError(f"train.holdout {holdout} must be in [0, {n}) for {n} feature samples")
        if max_samples < 0:
            raise ValueError(f"train.max_samples must be >= 0 (0: all), got {max_samples}")
        # held out by a hash of the sample id: the same samples whatever the order or the data size;
        # max_samples takes the next ones in the same order, so smaller subsets nest in larger ones
        by_hash = sorted(range(n), key=lambda i: hashlib.sha256(str(self.ds.ids[i]).encode()).hexdigest())
        held = set(by_hash[:holdout])
        used = set(by_hash[holdout:holdout + max_samples] if max_samples else by_hash[holdout:])
        self.heldout = sorted(held)  # feature indices never trained on
        self.index = sorted(used)  # training index -> feature index
        self.lengths = [min(self.ds.lengths[i], max_len) for i in self.index]
        self.target = getattr(self.ds, "target", "")
        self.manifest = self.ds.manifest  # provenance: the trainer checks it against its target

    def __len__(self) -> int:
        return len(self.index)

    def ids_masks(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(input_ids, loss_mask) per sample, truncated like training, without the states."""
        used, i = set(self.index), 0
        for shard in self.ds.manifest["shards"]:
            with open_safetensors(self.path / shard["file"], f"`eyas extract verify {self.path}`") as f:
                off = f.get_tensor("offsets").tolist()
                ids, mask = f.get_tensor("input_ids"), f.get_tensor("loss_mask")
            for a, b in zip(off[:-1], off[1:]):
                if i in used:
                    yield ids[a:min(b, a + self.max_len)], mask[a:min(b, a + self.max_len)]
                i += 1

    def load(self, indices: list[int]) -> list[dict[str, Any]]:
        return [self.ds[self.index[i]] for i in indices]

    def heldout_samples(self) -> list[dict[str, Any]]:
        return [self.ds[i] for i in self.heldout]

    @functools.cached_property
    def generated_tokens(self) -> int:
        """Assistant (synthesized) tokens in the samples trained on: what the data cost to make."""
        return sum(int(m.sum()) for _, m in self.ids_masks())

    def describe(self) -> dict[str, Any]:
        return {"source": self.kind, "features": str(self.path), "samples": len(self), "tokens": sum(self.lengths),
                "generated_tokens": self.generated_tokens,
                "heldout": len(self.heldout), "layer_ids": self.layer_ids}


class OnlineSource:
    """Token ids + masks in memory; the frozen target computes the states per micro-batch."""

    kind = "online"

    def __init__(self, path: str | os.PathLike, target: str | os.PathLike, layer_ids: list[int] | None, max_len: int,
                 device: str = "cpu", compute_dtype: str = "bf16", limit: int = 0, chat_template: str = ""):
        from eyas.extract import make_extractor

        self.path = Path(path)
        self.extractor = make_extractor(target, "hf", layer_ids or None, compute_dtype=compute_dtype, device=device,
                                        max_len=max_len, chat_template=chat_template)
        self.layer_ids = list(self.extractor.layer_ids)
        self.hidden_size = int(self.extractor.hidden_size)
        self.max_len = max_len
        self.samples = self._read(limit)
        self.lengths = [int(s["input_ids"].shape[0]) for s in self.samples]
        self.target = str(target)

    def _read(self, limit: int) -> list[dict[str, Any]]:
        out = []
        for n, rec in iter_jsonl(self.path, "online source: a conversations JSONL or a tokenized JSONL"):
            rec.setdefault("id", f"line{n}")
            if "input_ids" in rec:
                ids = torch.tensor(rec["input_ids"][: self.max_len], dtype=torch.int64)
                mask = torch.tensor(rec.get("loss_mask", [1] * len(rec["input_ids"]))[: self.max_len]).bool()
                s = {"id": str(rec["id"]), "input_ids": ids, "loss_mask": mask}
            elif "messages" in rec:
                r = self.extractor.renderer.render(rec, where=f"{self.path}:{n}")
                s = {"id": r["id"], "input_ids": r["input_ids"], "loss_mask": r["loss_mask"]}
            else:
                raise ValueError(f"{self.path}:{n}: expected 'messages' or 'input_ids'")
            if bool(s["loss_mask"].any()):
                out.append(s)
            if limit and len(out) >= limit:
                break
        if not out:
            raise ValueError(f"{self.path}: no sample with a loss token")
        return out

    def __len__(self) -> int:
        return len(self.samples)

    def ids_masks(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for s in self.samples:
            yield s["input_ids"], s["loss_mask"]

    def load(self, indices: list[int]) -> list[dict[str, Any]]:
        return self.extractor.extract([self.samples[i] for i in indices])

    def describe(self) -> dict[str, Any]:
        return {"source": self.kind, "data": str(self.path), "samples": len(self), "tokens": sum(self.lengths),
                "layer_ids": self.layer_ids}


def open_source(cfg: TrainConfig, target_dir: str | os.PathLike, device: str = "cpu") -> OfflineSource | OnlineSource:
    """The indexed source named by `cfg.source` (a TrainConfig)."""
    if not cfg.features:
        raise ValueError("no training data: pass --features FEAT_DIR (offline) or a conversations JSONL (online)")
    if cfg.source == "offline":
        src = OfflineSource(cfg.features, cfg.max_len, cfg.holdout, cfg.max_samples)
        if cfg.layer_ids and list(cfg.layer_ids) != src.layer_ids:
            raise ValueError(f"train.layer_ids {cfg.layer_ids} != the features' layer ids {src.layer_ids}")
        return src
    if cfg.source == "online":
        return OnlineSource(cfg.features, target_dir, list(cfg.layer_ids) or None, cfg.max_len,
                            device=device, compute_dtype="bf16" if device != "cpu" else "fp32")
    if cfg.source == "streaming":
        raise ValueError("the streaming source is not indexed: use open_data")
    raise ValueError(f"unknown train.source {cfg.source!r}: offline | online | streaming")


# ---------------------------------------------------------------------------------------------
# the global micro-batch order and its position


@dataclass
class Position:
    epoch: int = 0
    index: int = 0  # next micro-batch of `epoch` in the global order
    consumed: int = 0  # micro-batches consumed since the start of training

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "consumed": self.consumed}


class GlobalBatches:
    """Deterministic global micro-batch order over an indexed source; rank slices per step."""

    def __init__(self, lengths: list[int], token_budget: int, seed: int):
        if not lengths:
            raise ValueError("no samples to train on")
        self.lengths, self.token_budget, self.seed = list(lengths), token_budget, seed
        self.fingerprint = {"num_samples": len(lengths), "num_tokens": int(sum(lengths)),
                            "token_budget": token_budget, "seed": seed}
        self.pos = Position()
        self._plans: dict[int, list[list[int]]] = {}

    def plan(self, epoch: int) -> list[list[int]]:
        if epoch not in self._plans:
            self._plans = {epoch: plan_epoch(self.lengths, self.token_budget, self.seed, epoch)}  # one epoch in memory
        return self._plans[epoch]

    def take(self, n: int) -> list[list[int]]:
        """The next n micro-batches of the global order (crossing epochs); advances the position."""
        out = []
        for _ in range(n):
            plan = self.plan(self.pos.epoch)
            if self.pos.index >= len(plan):
                self.pos = Position(self.pos.epoch + 1, 0, self.pos.consumed)
                plan = self.plan(self.pos.epoch)
            out.append(plan[self.pos.index])
            self.pos = Position(self.pos.epoch, self.pos.index + 1, self.pos.consumed + 1)
        return out

    def for_rank(self, world: int, accum: int, rank: int) -> list[list[int]]:
        """One optimizer step: this rank's `accum` micro-batches (global index base + a*world + rank)."""
        step = self.take(world * accum)
        return [step[a * world + rank] for a in range(accum)]

    def state_dict(self) -> dict[str, Any]:
        return {**self.pos.to_dict(), **self.fingerprint}

    def load_state_dict(self, st: dict[str, Any]) -> None:
        diff = {k: (st.get(k), v) for k, v in self.fingerprint.items() if st.get(k) != v}
        if diff:
            raise ValueError(f"cannot resume: the data position was saved for other data / budget / seed "
                             f"(saved, now): {diff}")
        self.pos = Position(int(st["epoch"]), int(st["index"]), int(st["consumed"]))


# ---------------------------------------------------------------------------------------------
# streaming


class StreamEnded(RuntimeError):
    pass


class StreamBatches:
    """Micro-batches from an iterable of sample dicts, in arrival order, sorted by length within
    a window of `window` samples. Each rank consumes its own stream (producers shard the data);
    the position is the count of samples consumed, for the record (a live stream is not replayable)."""

    def __init__(self, stream, token_budget: int, max_len: int, window: int = 64):
        self.it = iter(stream)
        self.budget, self.max_len, self.window = token_budget, max_len, window
        self.buffer: list[list[dict[str, Any]]] = []
        self.consumed = 0

    def _refill(self) -> None:
        got = []
        for s in self.it:
            got.append(s)
            if len(got) >= self.window:
                break
        if not got:
            raise StreamEnded("the stream ended")
        order = sorted(range(len(got)), key=lambda i: int(got[i]["input_ids"].shape[0]))
        lengths = [min(int(s["input_ids"].shape[0]), self.max_len) for s in got]
        self.buffer += [[got[i] for i in b] for b in pack_by_length(lengths, self.budget, order)]

    def next_items(self) -> list[dict[str, Any]]:
        if not self.buffer:
            self._refill()
        items = self.buffer.pop(0)
        self.consumed += len(items)
        return items

    def state_dict(self) -> dict[str, Any]:
        return {"stream_consumed": self.consumed}


STREAM_VOCAB_SAMPLES = 512  # streaming: rank 0 counts the draft vocab over the first samples it receives


class StreamSource:
    """The consumer side of `eyas extract --mode streaming` for one rank (`eyas.extract.stream.open_consumer`:
    `train.features` = tcp://HOST:PORT?producers=N, rank r binds PORT + r). Layer ids and hidden size come
    from the producers' HELLO. Samples counted for the vocab are replayed first, none is lost."""

    kind = "streaming"

    def __init__(self, address: str, rank: int, max_len: int, token_budget: int):
        from eyas.extract.stream import open_consumer

        self.address = address
        self.consumer = open_consumer(address, rank)
        info = self.consumer.wait_ready()
        self.layer_ids: list[int] = list(info["layer_ids"])
        self.hidden_size: int = int(info["hidden_size"])
        self.target: str = str(info.get("target", ""))
        self.max_len = max_len
        self._live = iter(self.consumer)
        self._head: list[dict[str, Any]] = []
        self.batches = StreamBatches(self._items(), token_budget, max_len)

    def _items(self) -> Iterator[dict[str, Any]]:
        while self._head:
            yield self._head.pop(0)
        yield from self._live

    def ids_masks(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for s in self._live:
            self._head.append(s)
            if len(self._head) >= STREAM_VOCAB_SAMPLES:
                break
        for s in self._head:
            yield s["input_ids"][: self.max_len], s["loss_mask"][: self.max_len]

    def describe(self) -> dict[str, Any]:
        return {"source": self.kind, "address": self.address, "layer_ids": self.layer_ids,
                "vocab_samples": STREAM_VOCAB_SAMPLES}

    def close(self) -> None:
        self.consumer.close()


# ---------------------------------------------------------------------------------------------
# what the loop asks for: this rank's micro-batches of the next step


class IndexedData:
    """offline / online: the global order, sliced per rank (resumable anywhere)."""

    def __init__(self, src: OfflineSource | OnlineSource, token_budget: int, seed: int):
        self.src = src
        self.order = GlobalBatches(src.lengths, token_budget, seed)

    def next_step(self, world: int, accum: int, rank: int) -> list[list[dict[str, Any]]] | None:
        return [self.src.load(idx) for idx in self.order.for_rank(world, accum, rank)]

    def state_dict(self) -> dict[str, Any]:
        return self.order.state_dict()

    def load_state_dict(self, st: dict[str, Any]) -> None:
        self.order.load_state_dict(st)

    def close(self) -> None:
        pass


class StreamData:
    """streaming: each rank its own stream; None once it ends (the loop stops every rank then).
    A resumed streaming run continues with whatever the producers send (a live stream is not replayed)."""

    def __init__(self, src: StreamSource):
        self.src = src

    def next_step(self, world: int, accum: int, rank: int) -> list[list[dict[str, Any]]] | None:
        try:
            return [self.src.batches.next_items() for _ in range(accum)]
        except StreamEnded:
            return None

    def state_dict(self) -> dict[str, Any]:
        return {"streaming": True, **self.src.batches.state_dict()}

    def load_state_dict(self, st: dict[str, Any]) -> None:
        if not st.get("streaming"):
            raise ValueError("cannot resume: the checkpoint was trained from an indexed source, not a stream")

    def close(self) -> None:
        self.src.close()


def open_data(cfg: TrainConfig, target_dir: str | os.PathLike, rank: int, device: str = "cpu"):
    """(source, step data) for `cfg.source`."""
    if cfg.source == "streaming":
        if not cfg.features:
            raise ValueError("train.source=streaming needs --features tcp://HOST:PORT[?producers=N] (the consumer address)")
        src = StreamSource(cfg.features, rank, cfg.max_len, cfg.token_budget)
        if cfg.layer_ids and list(cfg.layer_ids) != src.layer_ids:
            raise ValueError(f"train.layer_ids {cfg.layer_ids} != the producers' layer ids {src.layer_ids}")
        return src, StreamData(src)
    src = open_source(cfg, target_dir, device)
    return src, IndexedData(src, cfg.token_budget, cfg.seed)
