"""Length-grouped packing: every batcher's one rule, and the training epoch plan built on it."""

import torch

from eyas.packing import pack_by_length, plan_epoch


def test_pack_by_length():
    assert pack_by_length([5, 3, 9, 4], 12) == [[1, 3], [0], [2]]  # the module docstring's example
    assert pack_by_length([20, 2], 10) == [[1], [0]]  # longer than the budget: a batch of its own
    assert pack_by_length([4, 4, 4], 12, order=[2, 0]) == [[2, 0]]  # only the given order, in it
    assert pack_by_length([], 8) == []


def test_plan_epoch_budget_determinism():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(10, 500, (300,), generator=g).tolist() + [900]  # one longer than the budget
    budget = 800
    e0 = plan_epoch(lengths, budget, seed=3, epoch=0)
    flat = sorted(i for b in e0 for i in b)
    assert flat == list(range(len(lengths)))  # every sample exactly once per epoch
    for b in e0:
        assert max(lengths[i] for i in b) * len(b) <= budget or len(b) == 1
    assert [900] in [[lengths[i] for i in b] for b in e0]
    padded = sum(max(lengths[i] for i in b) * len(b) for b in e0)
    assert sum(lengths) / padded > 0.8  # length grouping: little padding
    assert plan_epoch(lengths, budget, seed=3, epoch=0) == e0  # deterministic per (seed, epoch)
    assert plan_epoch(lengths, budget, seed=3, epoch=1) != e0 and plan_epoch(lengths, budget, seed=4, epoch=0) != e0
    # no shuffle: sorted pools, the same every epoch
    assert plan_epoch(lengths, budget, 0, 0, shuffle=False) == plan_epoch(lengths, budget, 0, 5, shuffle=False)
