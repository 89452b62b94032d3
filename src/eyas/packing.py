"""Length-grouped packing, the one rule every batcher uses (extraction forwards, training
micro-batches, streamed samples): walk indices in ascending length and cut a batch when
the padded size (longest x count) would pass the budget; a longer sample is a batch alone.

    pack_by_length([5, 3, 9, 4], 12)            -> [[1, 3], [0], [2]]   (3,4 -> 4x2=8; +5 -> 15 > 12)
    plan_epoch(lengths, budget, seed, epoch)    -> the training micro-batches of one epoch
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence


def pack_by_length(lengths: Sequence[int], budget: int, order: Sequence[int] | None = None) -> list[list[int]]:
    """Indices of `order` (default: all, sorted by length) cut greedily so that longest x count <= budget."""
    if order is None:
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i in order:
        L = int(lengths[i])
        if cur and max(longest, L) * (len(cur) + 1) > budget:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, L)
    return batches + ([cur] if cur else [])


def plan_epoch(lengths: Sequence[int], token_budget: int, seed: int, epoch: int, shuffle: bool = True,
               pool_batches: int = 32) -> list[list[int]]:
    """One epoch's micro-batches: a seeded permutation cut into pools of `pool_batches` x
    (budget / mean length) samples, each pool packed by length, then the batch order shuffled.
    The same (lengths, budget, seed, epoch) gives the same batches."""
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    n = len(lengths)
    order = list(range(n))
    rng = random.Random(seed * 1_000_003 + epoch)
    if shuffle:
        rng.shuffle(order)
    mean = max(1.0, sum(lengths) / max(n, 1))
    pool = max(1, pool_batches * math.ceil(token_budget / mean))
    batches: list[list[int]] = []
    for p in range(0, n, pool):
        batches += pack_by_length(lengths, token_budget, sorted(order[p : p + pool], key=lambda i: lengths[i]))
    if shuffle:
        rng.shuffle(batches)
    return batches
