"""#31 step 1: the draft-or-lookup rules replayed on teacher-forced data (eyas.draft.hybrid): the draft rule
counts what eyas.draft.simulate counts, the lookup is vLLM's n-gram matcher (checked against a plain one),
and the rules pick as they say."""

from __future__ import annotations

import json
import random
from pathlib import Path

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
    from eyas.hybrid_serve import parse_lookup, policy_of, policy_spec

    assert parse_lookup("none") is None and parse_lookup("") is None
    assert parse_lookup("ngram:2:4") == {"rule": "lookup>draft", "ngram": [2, 4]}
    assert parse_lookup("ngram:1:3:lookupL>=3") == {"rule": "lookupL>=3", "ngram": [1, 3]}
    sx = parse_lookup("suffix")
    assert sx["rule"] == "lookup>draft" and sx["suffix"]["max_tree_depth"] == 24
    assert parse_lookup("suffix:lookupL>=3")["rule"] == "lookupL>=3"
    assert policy_spec(parse_lookup("suffix:agree")) == "suffix:agree"
    assert policy_spec(parse_lookup("ngram:3:4:agree")) == "ngram:3:4:agree"
    for bad in ("ngram", "ngram:4:2", "ngram:0:2", "suffixes", "ngram:2:4:sometimes", "suffix:often"):
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


def test_a_policy_is_served_from_links_beside_the_draft_and_the_draft_is_untouched(tmp_path, tiny_llama):
    """with_policy: a dir of links to the draft's files with the policy in its own config.json; hybrid
    methods resolve to it (bare `hybrid`: the draft's own policy, else n-gram 2..4 lookup>draft)."""
    import json

    from eyas.bench.throughput import methods_for, proposers
    from eyas.draft.contract import random_draft
    from eyas.export import write_draft
    from eyas.hybrid_serve import POLICY_KEY, hybrid_method, parse_lookup, policy_spec, with_policy

    state, cfg = random_draft(tiny_llama, draft_vocab_size=512)
    draft = write_draft(state, cfg, tmp_path / "draft", tiny_llama)
    before = {f.name: f.read_bytes() for f in draft.iterdir()}
    pol = parse_lookup("ngram:3:4:agree")
    served = with_policy(draft, pol, tmp_path / "served")
    assert json.loads((served / "config.json").read_text())[POLICY_KEY] == pol
    assert {f.name for f in served.iterdir()} == set(before)
    assert all((served / n).is_symlink() and (served / n).read_bytes() == b for n, b in before.items() if n != "config.json")
    assert {f.name: f.read_bytes() for f in draft.iterdir()} == before  # nothing written in the draft
    assert with_policy(draft, pol, tmp_path / "served") == served  # again: the same dir, still right
    alone = with_policy(served, None, tmp_path / "alone")  # a policy stripped again
    assert POLICY_KEY not in json.loads((alone / "config.json").read_text())
    assert policy_spec(pol) == "ngram:3:4:agree" and policy_spec(None) == "none"

    bare = hybrid_method("hybrid", draft)
    assert json.loads((bare / "config.json").read_text())[POLICY_KEY] == parse_lookup("ngram:2:4")
    assert json.loads((hybrid_method("hybrid", served) / "config.json").read_text())[POLICY_KEY] == pol
    with pytest.raises(ValueError, match="needs an exported EAGLE-3 draft"):
        hybrid_method("hybrid", None)
    got = proposers(draft, ["ngram", "hybrid:ngram:1:3"], 3)
    assert got["draft"] == draft and got["ngram"] == "ngram"
    assert json.loads((got["hybrid:ngram:1:3"] / "config.json").read_text())[POLICY_KEY]["ngram"] == [1, 3]
    specs = methods_for(draft, ["hybrid:ngram:1:3"], 3)
    assert specs["hybrid:ngram:1:3@k3"]["method"] == "eagle3" and specs["draft@k3"]["model"] == str(draft)


def test_served_policies_refuse_what_vllm_cannot_serve():
    from eyas.hybrid_serve import parse_lookup

    with pytest.raises(ValueError, match="probabilities"):
        parse_lookup("ngram:2:4:conf<0.5")
    with pytest.raises(ValueError, match="only `eyas run`"):
        parse_lookup("auto")


def test_suffix_is_skipped_with_why_where_arctic_inference_is_missing(monkeypatch):
    import importlib.util

    from eyas.bench.throughput import proposers
    from eyas.vllm_runner import speculative_config, suffix_available

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "arctic_inference" else real(n, *a))
    said = []
    assert "arctic-inference" in suffix_available()
    assert proposers(None, ["suffix", "ngram"], 3, log=said.append) == {"ngram": "ngram"}
    assert "suffix skipped" in said[0]
    assert speculative_config("suffix", 3) == {"method": "suffix", "num_speculative_tokens": 3}


def test_run_picks_the_policy_that_beats_the_draft_alone():
    from eyas.pipeline import _pick

    alone = {"tokens_per_step": 1.5}
    h = {"ngram:2:4:lookup>draft": {"tokens_per_step": 1.8, "hybrid": {"lookup": {"steps": 3, "accepted": 4}}},
         "ngram:3:4:lookup>draft": {"tokens_per_step": 1.7}}
    got = _pick(alone, h, auto=True)
    assert got["exported"] == "ngram:2:4:lookup>draft" and got["gain"] == pytest.approx(0.2)
    assert got["sources"]["ngram:2:4:lookup>draft"]["lookup"]["accepted"] == 4
    assert _pick({"tokens_per_step": 1.9}, h, auto=True)["exported"] == "none"  # the draft alone wins: no lookup
    assert _pick({"tokens_per_step": 1.9}, h, auto=False)["exported"] == "ngram:2:4:lookup>draft"  # named: kept


def _coin_target(vllm_target: Path, dest: Path, a: int, b: int, pa: float) -> Path:
    """vllm_target rewired so that every position's next token is `a` with probability pa and `b` with 1 - pa,
    whatever the context: every embedding row is e_0 and the attention and MLP outputs are zero, so the last
    hidden state is e_0 everywhere; after the final norm it is sqrt(H) e_0, and lm_head's column 0 holds the
    log-probabilities / sqrt(H) (every other token -30)."""
    import json as _json
    import math
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(vllm_target, dest)
    cfg = _json.loads((dest / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (dest / "config.json").write_text(_json.dumps(cfg))
    sd = load_file(str(dest / "model.safetensors"))
    V, H = sd["model.embed_tokens.weight"].shape
    emb = torch.zeros(V, H)
    emb[:, 0] = 1.0
    sd["model.embed_tokens.weight"] = emb.to(sd["model.embed_tokens.weight"].dtype)
    for name in sd:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            sd[name].zero_()
    sd["model.norm.weight"].fill_(1.0)
    head = torch.zeros(V, H)
    head[:, 0] = -30.0 / math.sqrt(H)
    head[a, 0], head[b, 0] = math.log(pa) / math.sqrt(H), math.log(1 - pa) / math.sqrt(H)
    sd["lm_head.weight"] = head.to(sd["model.embed_tokens.weight"].dtype)
    save_file(sd, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def _coin_stats(token_ids: list[list[int]], a: int) -> tuple[float, float, int]:
    """(share of a, share of steps that repeat the previous token, tokens) over the generated ids."""
    n = sum(len(t) for t in token_ids)
    share = sum(x == a for t in token_ids for x in t) / n
    pairs = [(x, y) for t in token_ids for x, y in zip(t, t[1:])]
    return share, sum(x == y for x, y in pairs) / len(pairs), n


@pytest.mark.slow
def test_sampling_with_the_hybrid_keeps_the_targets_distribution(vllm_target, tmp_path):
    """Lossless under sampling (temperature 1, draft_sample_method probabilistic): on a target whose next token is
    a coin (a: 0.6, b: 0.4, whatever came before), the hybrid's output has the coin's statistics (share of a,
    and repeats of the previous token, 0.6^2 + 0.4^2 = 0.52, which a lookup that copies history would push
    up) within 4 standard errors while the lookup's tokens are accepted on many steps; so has vLLM's own
    n-gram speculation. Controls: the lookup's rows left with the draft's probabilities (EYAS_HYBRID_ONE_HOT=0)
    fail the statistics (the test can tell); vLLM CPU's sampled verification without eyas's SPEC_SAMPLING_EXPAND
    fix (EYAS_VLLM_FIXES=0), n-gram and hybrid, is visibly broken: off the statistics or its acceptance
    collapsed."""
    import math

    from eyas.draft.contract import random_draft
    from eyas.export import write_draft
    from eyas.hybrid_serve import parse_lookup
    from eyas.vllm_runner import run

    a, b, pa = 1000, 2000, 0.6
    target = _coin_target(vllm_target, tmp_path / "coin", a, b, pa)
    state, cfg = random_draft(target, draft_vocab_size=1024)
    draft = write_draft(state, cfg, tmp_path / "draft", target, lookup=parse_lookup("ngram:1:2"))
    convs = [[{"role": "user", "content": f"Toss {i}."}] for i in range(24)]
    base = {"target": str(target), "k": 3, "max_tokens": 200, "temperature": 1.0, "request_seed": None,
            "ignore_eos": True, "return_token_ids": True, "return_texts": False, "kv_cache_gib": 1,
            "dtype": "float32", "batches": [{"name": "coin", "conversations": convs}]}
    hybrid = {"draft": str(draft), "draft_sample_method": "probabilistic"}
    cases = {"hybrid": (hybrid, {}), "ngram": ({"draft": "ngram"}, {}),
             "one_hot_off": (hybrid, {"EYAS_HYBRID_ONE_HOT": "0"}),
             "ngram_unfixed": ({"draft": "ngram"}, {"EYAS_VLLM_FIXES": "0"}),
             "hybrid_unfixed": (hybrid, {"EYAS_VLLM_FIXES": "0"})}
    n = 24 * 200
    se_share, se_rep = math.sqrt(pa * (1 - pa) / n), math.sqrt(0.52 * 0.48 / n)
    got = {}
    for name, (spec, env) in cases.items():
        stats = tmp_path / f"{name}.json"
        res = run({**base, **spec}, timeout=900, env={"EYAS_HYBRID_STATS": str(stats), **env})["batches"][0]
        share, rep, m = _coin_stats(res["token_ids"], a)
        assert m == n
        got[name] = {"share": round(share, 4), "repeat": round(rep, 4), "counters": res["counters"],
                     "hybrid": res.get("hybrid"), "ok": abs(share - pa) < 4 * se_share and abs(rep - 0.52) < 4 * se_rep}
    print(json.dumps(got))
    assert got["hybrid"]["hybrid"]["lookup"]["accepted"] > 500, got  # the lookup's tokens do go through
    assert got["ngram"]["counters"]["num_accepted_tokens"] > 500, got
    assert got["hybrid"]["ok"] and got["ngram"]["ok"], got
    assert not got["one_hot_off"]["ok"], got
    # Without the fix, the target's logits are divided by uninitialized memory, so which symptom shows depends on
    # what that memory holds on the machine: the output off the coin's statistics (seen here), or acceptance
    # collapsed with the output still on them (seen in CI: n-gram 331 accepted against 2,253 fixed). One of the two.
    for name, fixed in (("ngram_unfixed", "ngram"), ("hybrid_unfixed", "hybrid")):
        collapsed = got[name]["counters"]["num_accepted_tokens"] < got[fixed]["counters"]["num_accepted_tokens"] / 3
        assert not got[name]["ok"] or collapsed, (name, got)


def test_a_draft_with_a_policy_keeps_vllm_on_the_runner_the_plugin_wraps():
    """On GPUs vLLM defaults to Model Runner V2, which the plugin cannot wrap: a served EAGLE-3 draft whose
    config names a lookup policy is listed among V2's unsupported features (vLLM then picks V1 itself);
    a draft without one, or another method, is not."""
    from types import SimpleNamespace as NS

    from vllm.config import VllmConfig

    from eyas.hybrid_serve import V2_REASON, register

    register()
    register()  # idempotent
    f = VllmConfig._get_v2_model_runner_unsupported_features
    assert f.eyas_hybrid and not getattr(f.__closure__[0].cell_contents, "eyas_hybrid", False)

    def cfg(method, policy):
        hf = {"eyas_lookup": policy} if policy else {}
        return NS(parallel_config=NS(distributed_executor_backend=None, pipeline_parallel_size=1, use_ubatching=False),
                  speculative_config=NS(method=method, parallel_drafting=False, use_heterogeneous_vocab=False,
                                        draft_model_config=NS(hf_config=hf)))

    assert V2_REASON in f(cfg("eagle3", {"rule": "lookup>draft", "ngram": [2, 4]}))
    assert V2_REASON not in f(cfg("eagle3", None)) and V2_REASON not in f(cfg("ngram", None))
