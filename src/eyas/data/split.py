"""Deterministic cap and train/eval split, both driven by a seeded hash of the record id."""

from __future__ import annotations

import hashlib


def unit(key: str, seed: int, salt: str) -> float:
    """A stable number in [0, 1) for `key`, independent of order and platform."""
    h = hashlib.sha256(f"{salt}:{seed}:{key}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64


def cap(records: list[dict], n: int, seed: int) -> list[dict]:
    """A seeded shuffle by hashed id, then the first `n` (0 = all)."""
    out = sorted(records, key=lambda r: unit(r["id"], seed, "order"))
    return out[:n] if n > 0 else out


def split(records: list[dict], eval_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, eval): a record is in eval iff its hashed id falls below `eval_fraction`.

    The decision depends on the id alone, so it is the same whatever else is fetched or
    capped, and the two sides can never share an id.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"data.eval_fraction must be in [0, 1), got {eval_fraction}")
    train, eval_ = [], []
    for r in records:
        (eval_ if unit(r["id"], seed, "split") < eval_fraction else train).append(r)
    return train, eval_
