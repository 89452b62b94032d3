"""#31 step 1: the draft-or-lookup rules replayed on teacher-forced data (eyas.draft.hybrid): the draft rule
counts what eyas.draft.simulate counts, the lookup is vLLM's n-gram matcher (checked against a plain one),
and the rules pick as they say."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from eyas.draft.hybrid import lookup, rule, tokens_per_step, walk_rules
from eyas.draft.simulate import walk

K = 3


def plain_lookup(t: list[int], lo: int, hi: int, k: int) -> tuple[list[int], int]:
    """The longest suffix n-gram (hi down to lo) that occurs earlier, its earliest occurrence; the k tokens after."""
    for n in range(min(hi, len(t) - 1), lo - 1, -1):
        suffix = t[-n:]
        for j in range(len(t) - n):
            if t[j:j + n] == suffix:
                return t[j + n:j + n + k], n
    return [], 0


def _sequence(seed: int, T: int = 120) -> list[int]:
    rng = random.Random(seed)
    base = [rng.randrange(20) for _ in range(15)]
    return [rng.choice([base[i % 15], rng.randrange(20)]) for i in range(T)]  # repeats: lookup finds matches


@pytest.mark.parametrize("seed", range(4))
def test_lookup_is_vllms_ngram_matcher(seed):
    t = _sequence(seed)
    for end in range(2, len(t), 7):
        got = lookup(np.asarray(t[:end], dtype=np.int32), 2, 4, K, 1 << 30)
        assert got == plain_lookup(t[:end], 2, 4, K), end


def test_draft_rule_counts_what_the_simulator_counts():
    t = _sequence(7)
    gen = [False] * 30 + [True] * 40 + [False] * 10 + [True] * 40
    rng = random.Random(1)
    guesses = [[t[p + 2 + i] if p + 2 + i < len(t) and rng.random() < 0.6 else -1 for i in range(K)]
               for p in range(len(t))]
    drafts, per_pos = walk(torch.tensor(guesses).T, torch.tensor(t), torch.tensor(gen))
    c = walk_rules(guesses, [1.0] * len(t), t, gen, {"draft": rule("draft", K)}, K)["draft"]
    assert (c["drafts"], c["accepted"]) == (drafts, sum(per_pos)) and c["steps"] == drafts
    assert c["tokens"] == sum(gen) - 2  # two replies: every token after each reply's first (the prefill's)


def test_rules_pick_as_they_say():
    t = _sequence(3)
    gen = [False] * 20 + [True] * 100
    never = [[-1] * K for _ in t]  # a draft that is always wrong
    rules = {n: rule(n, K) for n in ("draft", "lookup", "lookup>draft", "lookupL>=4", "conf<0.5", "agree")}
    c = walk_rules(never, [0.9] * len(t), t, gen, rules, K)
    assert c["draft"]["accepted"] == 0 and tokens_per_step(c["draft"]) == 1.0
    assert c["lookup"]["lookup_steps"] == c["lookup"]["drafts"] > 0 and c["lookup"]["accepted"] > 0
    assert c["lookup>draft"]["accepted"] == c["lookup"]["accepted"] and c["lookup>draft"]["steps"] == c["lookup"]["steps"]
    assert c["lookupL>=4"]["lookup_steps"] < c["lookup"]["lookup_steps"]  # only the long matches
    assert c["conf<0.5"]["lookup_steps"] == 0  # the draft is confident (0.9) everywhere: never lookup
    assert c["agree"]["accepted"] == c["lookup"]["accepted"]  # a draft that never agrees adds nothing
    # every generated token is counted once, whatever the rule: the reply's tokens after its first
    for name, x in c.items():
        assert x["tokens"] == sum(gen) - 1, name
    with pytest.raises(ValueError, match="unknown rule"):
        rule("sometimes", K)


def test_simulate_rules_on_a_draft_equals_the_simulator_for_the_draft_rule():
    """With a real (random) Eagle3Draft over samples: the `draft` rule's drafts and accepted tokens are
    simulate_samples' counts, and per-domain counts sum to the whole."""
    from test_draft import random_draft, small_spec

    from eyas.draft.hybrid import simulate_rules
    from eyas.draft.simulate import simulate_samples

    spec = small_spec()
    model = random_draft(spec)
    g = torch.Generator().manual_seed(0)
    samples = []
    for n in (40, 55, 33):
        ids = torch.tensor(_sequence(n, n)) % spec.vocab_size
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n // 3:] = True
        samples.append({"input_ids": ids, "loss_mask": mask,
                        "aux_hidden_states": torch.randn(n, 3, spec.hidden_size, generator=g)})
    want = simulate_samples(model, samples, K)
    got = simulate_rules(model, samples, K, ["draft", "lookup>draft"], domains=["a", "b", "a"])
    d = got["draft"]["all"]
    assert (d["drafts"], d["accepted"]) == (want["num_drafts"], want["num_accepted_tokens"])
    for name in got:
        assert {x: got[name]["a"][x] + got[name]["b"][x] for x in d} == got[name]["all"]


def test_export_lookup_policies_parse_or_say_what_is_wrong():
    from eyas.hybrid_serve import parse_lookup, policy_of

    assert parse_lookup("none") is None and parse_lookup("") is None
    assert parse_lookup("ngram:2:4") == {"rule": "lookup>draft", "ngram": [2, 4]}
    assert parse_lookup("ngram:1:3:lookupL>=3") == {"rule": "lookupL>=3", "ngram": [1, 3]}
    for bad in ("ngram", "ngram:4:2", "ngram:0:2", "suffix", "ngram:2:4:sometimes"):
        with pytest.raises(ValueError, match="ngram:MIN:MAX|unknown rule"):
            parse_lookup(bad)
    assert policy_of({"eyas_lookup": {"rule": "agree", "ngram": [2, 4]}}) == {"rule": "agree", "ngram": [2, 4]}
    assert policy_of({"architectures": ["LlamaForCausalLMEagle3"]}) is None


def test_bench_rules_on_features_without_serving(tmp_path, tiny_llama):
    """`eyas bench rules` end to end but the vLLM part: a random draft's held-out features, every rule's
    tokens per step overall and per domain, the pure rules first."""
    from test_extract import write_convs

    from eyas.bench.rules import bench_rules
    from eyas.config import ExtractConfig
    from eyas.draft.contract import random_draft
    from eyas.export import write_draft
    from eyas.extract import extract

    write_convs(tmp_path / "convs.jsonl", 8)
    extract(ExtractConfig(target=str(tiny_llama), data=str(tmp_path / "convs.jsonl"), out=str(tmp_path / "feat"),
                          compute_dtype="fp32", layer_ids=[1, 2, 3]))
    state, cfg = random_draft(tiny_llama, draft_vocab_size=512)
    draft = write_draft(state, cfg, tmp_path / "draft", tiny_llama)
    res = bench_rules(tiny_llama, draft, tmp_path / "feat", 3, ["lookup>draft", "agree"], limit=4, serve=False)
    assert list(res["tokens_per_step"]) == ["draft", "lookup", "lookup>draft", "agree"]
    assert all(per["all"] >= 1.0 and set(per) == {"all", "pydoc"} for per in res["tokens_per_step"].values())
    assert res["table"].splitlines()[2].startswith("| draft |") and "served" not in res
