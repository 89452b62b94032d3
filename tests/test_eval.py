import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from eyas.acceptance import counters_from_prometheus, load_prompts, summarize
from eyas.draft.contract import random_draft
from eyas.evaluate import format_table
from eyas.export import write_draft


def write_prompts(path: Path, domains=("chat", "math"), per_domain=2) -> Path:
    rows = []
    for d in domains:
        for i in range(per_domain):
            rows.append({
                "id": f"{d}-{i}", "domain": d,
                "messages": [{"role": "user", "content": f"Question {i} about {d}: tell me something."},
                             {"role": "assistant", "content": "an old answer the target replaces"}],
            })
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_load_prompts(tmp_path):
    p = write_prompts(tmp_path / "p.jsonl")
    rows = load_prompts(p)
    assert len(rows) == 4 and rows[0]["domain"] == "chat"
    assert [m["role"] for m in rows[0]["messages"]] == ["user"]  # trailing assistant turn dropped
    assert len(load_prompts(p, limit=3)) == 3
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "assistant", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_prompts(tmp_path / "bad.jsonl")


def test_summarize():
    s = summarize({"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 12,
                   "accepted_per_pos": [6, 4, 2]}, k=3)
    assert s["acceptance_length"] == pytest.approx(2.2)  # 1 + accepted / drafts
    assert s["per_pos"] == pytest.approx([0.6, 0.4, 0.2])
    assert s["al_at_k"] == pytest.approx([1.6, 2.0, 2.2])
    assert summarize({}, k=None)["acceptance_length"] == 1.0  # plain decoding


def test_counters_from_prometheus():
    text = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 8.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 24.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 6.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""
    c = counters_from_prometheus(text)
    assert c == {"num_drafts": 8, "num_draft_tokens": 24, "num_accepted_tokens": 10, "accepted_per_pos": [6, 3, 1]}
    assert summarize(c, 3)["acceptance_length"] == pytest.approx(2.25)


def test_format_table():
    dom = {"n": 2, "generated_tokens": 64, "tokens_per_s": 10.0, "acceptance_length": 1.5, "per_pos": [0.3, 0.2, 0.0]}
    rep = {"k": 3, "n_prompts": 2, **dom, "domains": {"chat": dom}}
    t = format_table(rep)
    assert "chat" in t and "ALL" in t and "1.500" in t and "p2" in t


# ---------------------------------------------------------------- serve-eval bookkeeping (vLLM faked)


def test_on_checkpoint_keeps_best(tiny_llama, tmp_path, monkeypatch):
    from eyas import export, serve_eval
    from eyas.checkpoints import resolve_checkpoint
    from eyas.config import EvalConfig

    run = tmp_path / "run"
    state, cfg = random_draft(tiny_llama, draft_vocab_size=512)
    meta = {"draft_config": cfg, "layer_ids": cfg["eagle_aux_hidden_state_layer_ids"], "target": str(tiny_llama)}
    monkeypatch.setattr(export, "load_draft_state", lambda p: (state, meta))
    als = iter([1.4, 1.2, 1.7])
    calls = []

    def fake_measure(target, draft, prompts, **kw):
        calls.append((Path(draft), len(prompts), kw))
        al = next(als)
        return {"acceptance_length": al, "per_pos": [al - 1, 0, 0], "al_at_k": [al, al, al], "load_seconds": 1.0,
                "n_prompts": len(prompts), "generated_tokens": 10, "tokens_per_s": 5.0,
                "domains": {"chat": {"acceptance_length": al}}}

    monkeypatch.setattr(serve_eval, "measure_acceptance", fake_measure)
    ev = EvalConfig(prompts=str(write_prompts(tmp_path / "p.jsonl")), k=2, max_tokens=40, kv_cache_gib=1.5)
    callback = serve_eval.checkpoint_callback(run, ev, limit=3, target=str(tiny_llama))
    for step in (100, 200, 300):
        (run / "checkpoints" / f"step_{step}").mkdir(parents=True)
        rec = callback(run / "checkpoints" / f"step_{step}", step, {"est_al": 1.5, "sim_al": 1.6})
        assert rec["step"] == step and rec["eval_seconds"] >= 0 and rec["est_al"] == 1.5 and rec["k"] == 2
        assert rec["sim_al"] == 1.6  # the trainer's simulated AL beside the served one
        if step == 200:
            assert os.readlink(run / "checkpoints" / "best") == "step_100"  # 1.2 < 1.4: best unchanged
    assert calls[0][0] == run / "serve_eval" / "step_100" / "draft" and calls[0][1] == 3
    assert {k: calls[0][2][k] for k in ("k", "max_tokens", "kv_cache_gib")} == {"k": 2, "max_tokens": 40,
                                                                             "kv_cache_gib": 1.5}  # eval.*
    assert (calls[0][0] / "config.json").exists()
    recs = serve_eval.read_records(run)
    assert [r["true_al"] for r in recs] == [1.4, 1.2, 1.7] and [r["best"] for r in recs] == [True, False, True]
    assert set(recs[0]) >= {"step", "true_al", "est_al", "eval_seconds", "per_pos"}
    assert os.readlink(run / "checkpoints" / "best") == "step_300"
    assert json.loads((run / "checkpoints" / "best.json").read_text())["true_al"] == 1.7
    assert resolve_checkpoint(run, "best").name == "step_300"

    def failing(*a, **kw):
        raise RuntimeError("vLLM runner exited with 1")

    monkeypatch.setattr(serve_eval, "measure_acceptance", failing)
    (run / "checkpoints" / "step_400").mkdir()
    rec = callback(run / "checkpoints" / "step_400", 400, {"est_al": 1.9})
    assert rec["true_al"] is None and "exited with 1" in rec["error"]
    assert os.readlink(run / "checkpoints" / "best") == "step_300"
    assert serve_eval.checkpoint_callback(run, EvalConfig(), limit=3) is None  # no eval.prompts: no callback


# ---------------------------------------------------------------- vLLM


@pytest.fixture(scope="module")
def constant_target(vllm_target, tmp_path_factory) -> Path:
    """The tiny target with its final norm zeroed: all logits 0, so greedy decoding always picks token 0."""
    d = tmp_path_factory.mktemp("const") / "target"
    shutil.copytree(vllm_target, d)
    sd = load_file(str(d / "model.safetensors"))
    sd["model.norm.weight"].zero_()
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


@pytest.mark.slow
def test_eval_cli_random_draft(vllm_target, tmp_path, capsys):
    """Export of a random draft loads in vLLM, runs spec decoding; counters per domain add up; AL ~ 1."""
    from eyas.cli import main

    state, cfg = random_draft(vllm_target, draft_vocab_size=1024)
    draft = write_draft(state, cfg, tmp_path / "draft", vllm_target)
    prompts = write_prompts(tmp_path / "p.jsonl")
    rc = main(["eval", "--target", str(vllm_target), "--draft", str(draft), "--prompts", str(prompts),
               "--k", "3", "--max-tokens", "24", "--kv-cache-gib", "1", "--out", str(tmp_path / "r.json")])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    rep = json.loads(out[-1])
    assert "ALL" in "\n".join(out[:-1])
    assert rep == json.loads((tmp_path / "r.json").read_text())
    assert rep["num_drafts"] > 0 and rep["num_draft_tokens"] == 3 * rep["num_drafts"] and rep["counters_consistent"]
    assert 1.0 <= rep["acceptance_length"] < 1.5  # random draft: (almost) nothing accepted
    assert len(rep["per_pos"]) == 3 and rep["per_pos"] == sorted(rep["per_pos"], reverse=True)
    assert set(rep["domains"]) == {"chat", "math"}
    assert sum(d["num_drafts"] for d in rep["domains"].values()) == rep["num_drafts"]
    assert rep["generated_tokens"] > 0 and rep["tokens_per_s"] > 0


@pytest.mark.slow
def test_eval_baseline_and_perfect_draft(constant_target, tmp_path):
    """A draft that always proposes token 0 for a target that always emits it: AL = k + 1 exactly."""
    from eyas.acceptance import measure_acceptance

    state, cfg = random_draft(constant_target, draft_vocab_size=1024)
    state["norm.weight"].zero_()  # draft logits all 0 -> draft id 0 -> target id 0 + d2t[0] = 0
    draft = write_draft(state, cfg, tmp_path / "draft", constant_target, fmt="speculators")
    prompts = [{"id": "a", "domain": "x", "messages": [{"role": "user", "content": "Say something."}]}]
    rep = measure_acceptance(constant_target, draft, prompts, k=3, max_tokens=17, kv_cache_gib=1)
    assert rep["acceptance_length"] == pytest.approx(4.0)  # 1 prefill token + 4 per verify step
    assert rep["accepted_per_pos"] == [rep["num_drafts"]] * 3 and rep["al_at_k"] == pytest.approx([2.0, 3.0, 4.0])
    assert rep["num_drafts"] == 4 and rep["generated_tokens"] == 17
    assert rep["tokens_per_step"] == pytest.approx(17 / 5)  # prefill + 4 steps of 4 tokens

    base = measure_acceptance(constant_target, None, prompts, max_tokens=17, kv_cache_gib=1)  # `--draft none`
    assert base["draft"] is None and base["num_drafts"] == 0 and base["acceptance_length"] == 1.0
    assert base["generated_tokens"] == 17 and base["tokens_per_s"] > 0 and base["tokens_per_step"] == 1.0

    # vLLM's n-gram lookup: once the reply repeats token 0, the last n-gram is found and its continuation
    # (more 0s, up to k, fewer when the match is near the end) proposed and all accepted
    ngram = measure_acceptance(constant_target, "ngram:1:2", prompts, k=3, max_tokens=17, kv_cache_gib=1)
    assert ngram["num_drafts"] > 0 and ngram["num_accepted_tokens"] == ngram["num_draft_tokens"]
    steps = 17 - ngram["num_accepted_tokens"]
    assert ngram["tokens_per_step"] == pytest.approx(17 / steps) and ngram["tokens_per_step"] > 2
    with pytest.raises(ValueError, match="ngram:MIN:MAX"):
        measure_acceptance(constant_target, "ngram:3:1", prompts, k=3, max_tokens=17, kv_cache_gib=1)


@pytest.mark.slow
def test_served_draft_metrics(constant_target, tmp_path):
    """Deploy check: the serve command's server answers chat requests; /metrics carries the spec counters."""
    import requests

    from eyas.export import serve_argv
    from eyas.synth.server import VllmServer

    state, cfg = random_draft(constant_target, draft_vocab_size=1024)
    state["norm.weight"].zero_()
    draft = write_draft(state, cfg, tmp_path / "draft", constant_target)
    argv = serve_argv(constant_target, draft, k=3, cpu=True)
    assert argv[1:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model"]
    srv = VllmServer(constant_target, argv[5:], kv_cache_gib=1, log_path=tmp_path / "server.log", log_stats=True)
    with srv:
        for i in range(2):
            r = requests.post(srv.url + "/v1/chat/completions", timeout=120, json={
                "model": str(constant_target), "max_tokens": 9, "temperature": 0,
                "messages": [{"role": "user", "content": f"Hello {i}"}]})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 9
        c = counters_from_prometheus(requests.get(srv.url + "/metrics", timeout=30).text)
    assert c["num_drafts"] == 4 and c["num_draft_tokens"] == 12  # 2 requests x (1 + 4 + 4 tokens)
    assert 1 + c["num_accepted_tokens"] / c["num_drafts"] == pytest.approx(4.0)
    assert c["accepted_per_pos"] == [4, 4, 4]


@pytest.mark.slow
@pytest.mark.parametrize("lookup", ["ngram:1:2", "suffix"])
def test_hybrid_serves_lookup_where_the_draft_fails_and_keeps_the_output(constant_target, tmp_path, monkeypatch, lookup):
    """A random draft (never right for a target that always emits token 0) with a lookup policy in its
    config.json (vLLM's n-gram matcher, or suffix decoding's trees): served with eyas's plugin, the lookup
    takes the steps where it matches and its tokens are accepted; the output is the target's own (17
    zeros); EYAS_HYBRID=0 serves the draft alone."""
    from eyas.acceptance import measure_acceptance
    from eyas.hybrid_serve import parse_lookup
    from eyas.vllm_runner import suffix_available

    if lookup == "suffix" and suffix_available():
        pytest.skip(suffix_available())
    state, cfg = random_draft(constant_target, draft_vocab_size=1024)
    draft = write_draft(state, cfg, tmp_path / "draft", constant_target, lookup=parse_lookup(lookup))
    assert json.loads((draft / "config.json").read_text())["eyas_lookup"] == parse_lookup(lookup)
    prompts = [{"id": "a", "domain": "x", "messages": [{"role": "user", "content": "Say something."}]}]
    hyb = measure_acceptance(constant_target, draft, prompts, k=3, max_tokens=17, kv_cache_gib=1, return_texts=True)
    s = hyb["hybrid"]  # per source, from the worker's counts (EYAS_HYBRID_STATS, set by measure_acceptance)
    assert s["lookup"]["steps"] > 0 and s["lookup"]["accepted"] > 0 and s == hyb["domains"]["x"]["hybrid"]
    assert s["draft"]["accepted"] == 0  # the random draft: nothing
    assert s["lookup"]["steps"] + s["draft"]["steps"] == hyb["num_drafts"]  # every verify step is one source's
    assert hyb["tokens_per_step"] > 2 and hyb["generated_tokens"] == 17
    monkeypatch.setenv("EYAS_HYBRID", "0")
    alone = measure_acceptance(constant_target, draft, prompts, k=3, max_tokens=17, kv_cache_gib=1, return_texts=True)
    assert alone["hybrid"]["lookup"]["steps"] == 0 and alone["acceptance_length"] < 1.5
    assert hyb["domains"]["x"]["texts"] == alone["domains"]["x"]["texts"]  # greedy: the target's text either way
