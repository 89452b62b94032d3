"""The draft vocabulary: the N target tokens seen most often where the loss is taken.

`draft_ids` [Vd] are target ids sorted ascending; vLLM maps a draft id i back with
`target = i + d2t[i]` (d2t is an offset, not an id) and `t2d` [V] marks the kept ids.
Counting runs over loss-masked tokens only (the tokens the draft must predict); when
fewer than N distinct tokens occur, the lowest unused ids fill the rest. The result is
cached under a key made of the data *content* (a hash over every sample's ids and
mask), N and V, never the data's path, so re-extracted data gets a fresh vocab.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.io import atomic_path, atomic_write_text, open_safetensors
from eyas.lock import waiting

VERSION = 1


@dataclass
class DraftVocab:
    draft_ids: torch.Tensor  # [Vd] int64 target ids, ascending
    vocab_size: int  # V, the target's
    coverage: float  # fraction of loss-masked tokens whose id is in the draft vocab
    num_tokens: int  # loss-masked tokens counted
    num_seen: int  # distinct ids among them
    key: str = ""

    @property
    def size(self) -> int:
        return int(self.draft_ids.numel())

    @property
    def d2t(self) -> torch.Tensor:
        """[Vd] int64 offsets: target id = i + d2t[i]."""
        return self.draft_ids - torch.arange(self.size, dtype=torch.int64)

    @property
    def t2d(self) -> torch.Tensor:
        """[V] bool: which target ids the draft can emit."""
        m = torch.zeros(self.vocab_size, dtype=torch.bool)
        m[self.draft_ids] = True
        return m

    def info(self) -> dict:
        return {
            "draft_vocab_size": self.size,
            "vocab_size": self.vocab_size,
            "coverage": self.coverage,
            "num_tokens": self.num_tokens,
            "num_seen": self.num_seen,
            "key": self.key,
        }

    def save(self, path: str | os.PathLike) -> None:
        """safetensors: the ids as a tensor, the rest as JSON metadata (nothing is unpickled on load)."""
        from safetensors.torch import save_file

        with atomic_path(path) as tmp:
            save_file({"draft_ids": self.draft_ids.contiguous()}, str(tmp),
                      metadata={"info": json.dumps(self.info()), "version": str(VERSION)})

    @classmethod
    def load(cls, path: str | os.PathLike) -> DraftVocab:
        with open_safetensors(path, "delete it: the draft vocab is recomputed") as f:
            d = json.loads(f.metadata()["info"])
            ids = f.get_tensor("draft_ids")
        v = cls(ids, d["vocab_size"], d["coverage"], d["num_tokens"], d["num_seen"], d["key"])
        check_vocab(v.d2t, v.t2d, v.vocab_size)
        return v


def check_vocab(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int) -> None:
    """Assert the d2t / t2d pair is what vLLM expects for a target vocab of `vocab_size`."""
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool, (d2t.dtype, t2d.dtype)
    assert t2d.shape == (vocab_size,), (t2d.shape, vocab_size)
    ids = torch.arange(d2t.numel()) + d2t
    assert bool((ids >= 0).all()) and bool((ids < vocab_size).all()), "draft ids outside the target vocab"
    assert bool((ids[1:] > ids[:-1]).all()), "draft ids must be strictly ascending"
    assert torch.equal(t2d.nonzero().flatten(), ids), "t2d does not mark exactly the draft ids"


class TokenCounter:
    """One pass over (input_ids, loss_mask) pairs: counts of masked ids and a content hash."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.counts = torch.zeros(vocab_size, dtype=torch.int64)
        self.h = hashlib.sha256()
        self.n = 0

    def add(self, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> None:
        ids = torch.as_tensor(input_ids).to(torch.int64).flatten()
        mask = torch.as_tensor(loss_mask).to(torch.bool).flatten()
        if ids.shape != mask.shape:
            raise ValueError(f"input_ids {tuple(ids.shape)} and loss_mask {tuple(mask.shape)} differ in length")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(
                f"token id {int(ids.max())} is outside the target vocab of {self.vocab_size}: "
                "the features were made with another tokenizer"
            )
        self.h.update(ids.numpy().tobytes())
        self.h.update(mask.to(torch.uint8).numpy().tobytes())
        self.n += 1
        self.counts += torch.bincount(ids[mask], minlength=self.vocab_size)

    def content_hash(self) -> str:
        return self.h.hexdigest()


def vocab_key(content_hash: str, size: int, vocab_size: int) -> str:
    return hashlib.sha256(f"v{VERSION}:{content_hash}:{size}:{vocab_size}".encode()).hexdigest()[:24]


def top_n_vocab(counts: torch.Tensor, size: int, key: str = "") -> DraftVocab:
    """Top-`size` ids by count (ties: lower id first), filled with the lowest unused ids, sorted."""
    V = int(counts.numel())
    if not 0 < size <= V:
        raise ValueError(f"draft vocab size {size} must be in 1..{V} (the target vocab)")
    # stable sort on -count keeps ascending id order among equal counts (so unseen ids fill lowest first)
    order = torch.sort(-counts, stable=True).indices
    return vocab_from_counts(torch.sort(order[:size]).values.to(torch.int64), counts, key)


def vocab_from_counts(ids: torch.Tensor, counts: torch.Tensor, key: str = "") -> DraftVocab:
    """The draft vocab `ids` [Vd] with its coverage of the loss tokens counted in `counts` [V]."""
    total = int(counts.sum())
    cov = float(counts[ids].sum()) / total if total else 0.0
    return DraftVocab(ids, int(counts.numel()), cov, total, int((counts > 0).sum()), key)


def count_tokens(samples: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int) -> TokenCounter:
    counter = TokenCounter(vocab_size)
    for ids, mask in samples:
        counter.add(ids, mask)
    return counter


def build_draft_vocab(
    samples: Iterable[tuple[torch.Tensor, torch.Tensor]],
    size: int,
    vocab_size: int,
    cache_dir: str | os.PathLike | None = None,
) -> DraftVocab:
    """Count over `samples` (input_ids, loss_mask) and take the top `size`; cached in `cache_dir`
    under a key of the counted content (ids and masks), `size` and `vocab_size`."""
    cache = Path(cache_dir) if cache_dir else None
    counter = count_tokens(samples, vocab_size)
    if counter.n == 0:
        raise ValueError("no samples to count the draft vocab over")
    if int(counter.counts.sum()) == 0:
        raise ValueError("no loss-masked tokens in the data: the draft vocab (and the loss) would be empty")
    key = vocab_key(counter.content_hash(), size, vocab_size)
    if cache is None:
        return _top_n(counter, size, vocab_size, key)
    with waiting(cache / f"draft_vocab_{key}", "counting this draft vocab"):  # processes sharing the cache
        hit = _cached(cache, key)
        if hit is not None:
            return hit
        v = _top_n(counter, size, vocab_size, key)
        v.save(cache / f"draft_vocab_{key}.safetensors")
        atomic_write_text(cache / f"draft_vocab_{key}.json", json.dumps(v.info(), indent=2) + "\n")
    return v


def _top_n(counter: TokenCounter, size: int, vocab_size: int, key: str) -> DraftVocab:
    v = top_n_vocab(counter.counts, size, key)
    check_vocab(v.d2t, v.t2d, vocab_size)
    return v


def vocab_coverage(draft_ids: torch.Tensor, samples: Iterable[tuple[torch.Tensor, torch.Tensor]],
                   vocab_size: int) -> dict:
    """A given draft vocab (a warm start's) over new data: `DraftVocab.info()` with its coverage."""
    v = vocab_from_counts(draft_ids.to(torch.int64).cpu(), count_tokens(samples, vocab_size).counts)
    check_vocab(v.d2t, v.t2d, vocab_size)
    return v.info()


def _cached(cache: Path, key: str) -> DraftVocab | None:
    p = cache / f"draft_vocab_{key}.safetensors"
    if not p.exists():
        return None
    v = DraftVocab.load(p)
    return v if v.key == key else None
