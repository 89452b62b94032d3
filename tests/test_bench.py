"""`eyas bench al` / `bench throughput`: the acceptance suite (categories, none from training), the
tables and headline, and the sweep's side-by-side arithmetic and recommendation."""

from __future__ import annotations

import json

import pytest

from eyas.acceptance import tokens_per_decode_step
from eyas.bench import acceptance as A
from eyas.bench import suite as S
from eyas.bench import throughput as T


def test_sharegpt_rules():
    assert S.sharegpt_category("I want you to act as a travel guide.") == "roleplay"
    assert S.sharegpt_category("Fix this python function that sorts a list") == "coding"
    assert S.sharegpt_category("Write a short poem about autumn leaves") == "writing"
    assert S.sharegpt_category("What is the tallest mountain in Europe?") == "qa"
    assert S.sharegpt_category("thanks, that helps a lot") is None


def test_tokens_per_decode_step_counts_every_pass():
    assert tokens_per_decode_step(4 * 65, 4, {"num_accepted_tokens": 0}) == 1.0  # plain decoding
    # 4 requests, 256 decoded tokens, 64 of them accepted: 192 passes
    assert tokens_per_decode_step(260, 4, {"num_accepted_tokens": 64}) == pytest.approx(256 / 192)


@pytest.fixture(scope="module")
def suite_and_train(tmp_path_factory):
    """A small suite, then a 'training split' holding some of its prompts (one by id, one by text only)."""
    rows, info = S.build_suite(10, [])
    d = tmp_path_factory.mktemp("suite")
    by_id, by_text = rows[0], rows[15]
    train = [by_id, {"id": "other-1", "domain": "chat",
                     "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                                  {"role": "user", "content": "  " + by_text["messages"][-1]["content"] + " "}]}]
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    return rows, info, d / "train.jsonl", by_id, by_text


def test_suite_has_every_category_and_drops_training_prompts(suite_and_train):
    rows, info, train, by_id, by_text = suite_and_train
    assert set(info["per_category"]) == set(S.CATEGORIES) and info["short"] == []
    assert all(n == 10 for n in info["per_category"].values())
    assert len({r["id"] for r in rows}) == len(rows)
    again, info2 = S.build_suite(10, [train])
    ids = {r["id"] for r in again}
    assert by_id["id"] not in ids and by_text["id"] not in ids  # by id, and by content (whitespace aside)
    assert sum(info2["excluded"].values()) >= 2 and info2["short"] == []
    assert [r["id"] for r in S.build_suite(10, [train])[0]] == [r["id"] for r in again]  # seeded
    with pytest.raises(ValueError, match="bench.exclude"):
        S.build_suite(2, [train.parent / "missing.jsonl"])


def _rep(al_by_dom):
    doms = {d: {"n": 2, "acceptance_length": al, "tokens_per_decode_step": al - 0.1, "per_pos": [0.5]}
            for d, al in al_by_dom.items()}
    return {"domains": doms, "acceptance_length": 1.5, "per_pos": [0.5, 0.2]}


def test_headline_is_the_mean_over_categories_not_buckets():
    rep = _rep({"coding": 2.0, "math": 1.0, "ctx-1k": 9.0})
    h = A.headline(rep, ["coding", "math"])
    assert h["mean_al"] == pytest.approx(1.5) and h["mean_tokens_per_decode_step"] == pytest.approx(1.4)
    res = {"methods": {"draft": rep, "ngram": _rep({"coding": 1.2, "math": 1.1, "ctx-1k": 1.3})},
           "categories": ["coding", "math"], "buckets": ["ctx-1k"], "k": 2}
    res["headline"] = {m: A.headline(r, res["categories"]) for m, r in res["methods"].items()}
    table = A.format_tables(res)
    assert "| **mean over categories** | 4 | 1.500 | 1.400 | 1.150 | 1.050 |" in table
    assert "| ctx-1k | 2 | 9.000 | 8.900 | 1.300 | 1.200 |" in table and "| draft | 1.500 | 0.500 | 0.200 |" in table


def _run(method, k, rep, c, tps):
    return {"method": method, "k": k, "repeat": rep, "concurrency": c, "output_throughput": tps,
            "acceptance_length": 2.0 if method != "baseline" else None, "tokens_per_decode_step": 1.5}


def test_sweep_divides_by_the_baseline_of_its_own_repeat_and_recommends():
    runs = [_run("baseline", 1, 0, 1, 10), _run("baseline", 1, 1, 1, 20), _run("draft@k1", 1, 0, 1, 15),
            _run("draft@k1", 1, 1, 1, 20), _run("ngram@k1", 1, 0, 1, 11), _run("ngram@k1", 1, 1, 1, 21),
            _run("baseline", 1, 0, 8, 100), _run("baseline", 1, 1, 8, 100), _run("draft@k1", 1, 0, 8, 90),
            _run("draft@k1", 1, 1, 8, 80), _run("ngram@k1", 1, 0, 8, 95), _run("ngram@k1", 1, 1, 8, 99)]
    rows = T.summarize(runs)
    d1 = next(r for r in rows if (r["method"], r["concurrency"]) == ("draft", 1))
    assert d1["speedup"] == pytest.approx(1.25) and (d1["speedup_min"], d1["speedup_max"]) == (1.0, 1.5)
    rec = T.recommend(rows, draft="/d")
    assert rec[0]["method"] == "draft" and rec[0]["speculative_config"]["num_speculative_tokens"] == 1
    assert rec[1] == {"concurrency": 8, "method": "none", "k": 0, "speedup": 1.0, "speculative_config": None}
    table = T.format_tables(rows, rec)
    assert "(no speculation)" in table and '"method": "eagle3"' in table


@pytest.mark.slow
def test_sweep_against_real_servers(vllm_target):
    """Baseline and n-gram servers up side by side, two k rounds, two repeats: every reading recorded,
    counters scraped (tokens per decode step >= 1, plain decoding exactly 1), rows and a recommendation."""
    prompts = [[{"role": "user", "content": f"Repeat after me: {w} {w} {w} {w}"}] for w in ("apple", "river", "stone")]
    res = T.bench_sweep(vllm_target, None, prompts, [1, 2], [1, 2], ["ngram"], max_tokens=16, repeats=2,
                        kv_cache_gib=1)
    assert len(res["runs"]) == 2 * 2 * 2 * 2  # k rounds x repeats x concurrency x (baseline, ngram)
    assert [r["method"] for r in res["runs"][:4]] == ["baseline", "ngram@k1", "baseline", "ngram@k1"]
    assert [r["method"] for r in res["runs"][4:6]] == ["ngram@k1", "baseline"]  # repeat 1: order rotated
    for r in res["runs"]:
        assert r["completed"] == max(2 * r["concurrency"], 4) and r["generated"] >= 16 * r["completed"]
        if r["method"] == "baseline":
            assert r["num_drafts"] == 0 and r["tokens_per_decode_step"] == pytest.approx(1.0)
        else:
            assert r["tokens_per_decode_step"] >= 1.0
    assert {(r["method"], r["k"], r["concurrency"]) for r in res["rows"]} == {("ngram", k, c) for k in (1, 2) for c in (1, 2)}
    assert [r["concurrency"] for r in res["recommended"]] == [1, 2]


def test_greedy_mismatches_count_replies_that_leave_the_target_alone():
    """bench al's equality check: per method, replies differing from the target alone's (same prompts, same
    order), and the tokens each kept before its first difference; the token ids leave the reports."""
    from eyas.bench.acceptance import format_tables, greedy_mismatches

    def rep(ids, dtype="float32"):
        return {"dtype": dtype, "domains": {"chat": {"token_ids": ids[:2]}, "math": {"token_ids": ids[2:]}}}

    ref = [[1, 2, 3], [4, 5], [6, 7, 8]]
    reports = {"none": rep(ref), "ngram": rep([[1, 2, 3], [4, 5], [6, 7, 8]]),
               "draft": rep([[1, 2, 9], [4, 5, 6], [6, 7, 8]], "bfloat16")}
    g = greedy_mismatches(reports)
    assert g == {"ngram": {"replies": 3, "differ": 0, "tokens_before_first_difference": 0, "dtype": "float32"},
                 "draft": {"replies": 3, "differ": 2, "tokens_before_first_difference": 2 + 2, "dtype": "bfloat16"}}
    assert all("token_ids" not in d for r in reports.values() for d in r["domains"].values())
    res = {"methods": {}, "categories": [], "buckets": [], "headline": {}, "greedy_mismatches": g}
    res["methods"] = {m: {"domains": {}, "per_pos": [0.5]} for m in ("ngram", "draft")}
    res["headline"] = {m: {"mean_al": None, "mean_tokens_per_decode_step": None} for m in ("ngram", "draft")}
    assert "| draft | 2 / 3 | bfloat16 |" in format_tables(res)


def test_no_reading_resends_a_prompt_its_server_has_seen(monkeypatch, tiny_llama):
    """Suffix decoding answers a repeated prompt from its cache of served replies: every (repeat, concurrency)
    reading gets prompts no earlier reading sent, the same ones for every method, and warm-ups others."""
    import eyas.synth.server as server

    class Server:
        def __init__(self, target, args=(), **kw):
            self.url = "spec" if args else "base"

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    sent: list[tuple[str, tuple[str, ...]]] = []

    def fake(url, model, tok, reqs, max_tokens, concurrency, warmups=0):
        sent.append((url, tuple(r[0]["content"] for r in reqs)))
        return {"output_throughput": 10.0, "acceptance_length": None, "tokens_per_decode_step": 1.0}

    monkeypatch.setattr(server, "VllmServer", Server)
    monkeypatch.setattr(T, "run_serving_benchmark", fake)
    prompts = [[{"role": "user", "content": f"p{i}"}] for i in range(40)]
    T.bench_sweep(tiny_llama, None, prompts, [1, 4], [3], ["ngram"], max_tokens=8, repeats=2, log=lambda *a, **k: None)
    for url in ("base", "spec"):
        batches = [b for u, b in sent if u == url]
        warm, readings = batches[0], batches[1:]
        assert len(readings) == 4 and [len(b) for b in readings] == [4, 8, 4, 8]
        flat = [p for b in readings for p in b]
        assert len(set(flat)) == len(flat) and not set(warm) & set(flat)
    assert [b for u, b in sent if u == "base"][1:] == [b for u, b in sent if u == "spec"][1:]  # side by side
