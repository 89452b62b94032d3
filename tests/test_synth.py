"""Stage 1 (synth): driver logic against fake engines (fast), then vLLM in-process and served (slow)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from eyas.chat import load_chat_template, load_tokenizer, render_prompt_ids
from eyas.config import RunConfig, SynthConfig
from eyas.host import engine_dtype, vllm_env
from eyas.manifest import read_manifest
from eyas.synth import OUT_FILE, cli, plan_points, scan_jsonl, synthesize
from eyas.synth import engines as E
from eyas.synth.server import free_port

U = lambda s: {"role": "user", "content": s}  # noqa: E731
A = lambda s: {"role": "assistant", "content": s}  # noqa: E731
S = lambda s: {"role": "system", "content": s}  # noqa: E731


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_out(out: Path) -> dict[str, dict]:
    rows = [json.loads(x) for x in (out / OUT_FILE).read_text().splitlines()]
    assert len({r["id"] for r in rows}) == len(rows), "an id written twice"
    return {r["id"]: r for r in rows}


class FakeEngine:
    """Replies `r<prompt length>`; a prompt containing EMPTY gets "", one containing FAIL an error."""

    max_model_len = 2048

    def __init__(self, tok, fail: bool = True):
        self.tok, self.fail, self.calls = tok, fail, []

    def generate(self, reqs, sampling, on_done=None):
        self.calls.append(reqs)
        outs = []
        for r in reqs:
            text = self.tok.decode(r.prompt_ids)
            c = E.Completion(f"r{len(r.prompt_ids)}", 2, len(r.prompt_ids), "stop")
            if "EMPTY" in text:
                c.text = " "
            if "FAIL" in text and self.fail:
                c = E.Completion(error="HTTP 400: refused")
            outs.append(c)
            if on_done:
                on_done(c)
        return outs


class StreamingFake(FakeEngine):
    """FakeEngine with `stream`, as vLLM in-process and endpoints have: `slots` requests in flight, taking
    turns round robin, so a conversation's second turn runs after the others' first turns, as in continuous
    batching; a new conversation is pulled from `first` only when a slot frees, as the real engines do."""

    slots = 3

    def stream(self, first, sampling, then):
        from collections import deque

        firsts, todo = iter(first), deque()
        while True:
            while len(todo) < self.slots and (item := next(firsts, None)) is not None:
                todo.append(item)
            if not todo:
                return
            tag, r = todo.popleft()
            nxt = then(tag, self.generate([r], sampling)[0])
            if nxt is not None:
                todo.append((tag, nxt))


# ---------------------------------------------------------------- fast: no vLLM


def test_plan_points():
    conv = [S("s"), U("u1"), A("a1"), U("u2"), A("a2")]
    assert plan_points(conv, "regenerate") == [[S("s"), U("u1")], [U("u2")]]
    assert plan_points(conv, "last") == [[S("s"), U("u1"), A("a1"), U("u2")]]
    assert plan_points([U("u1"), U("u2"), A("a"), A("b"), U("u3")], "regenerate") == [[U("u1"), U("u2")], [U("u3")]]
    assert plan_points([S("s"), A("hello"), U("u")], "regenerate") == [[S("s"), U("u")]]


@pytest.fixture(scope="module")
def tok_template(embedded_target):
    return load_tokenizer(embedded_target), load_chat_template(embedded_target)


def test_no_usable_prompts_is_an_error_not_a_complete_synthesis(tmp_path, embedded_target):
    """An empty or all-invalid prompts file names itself and what was wrong; nothing is written."""
    for name, lines in (("empty", []), ("bad", ["{not json", {"messages": [U("no id")]}, {"id": "x", "messages": []}])):
        prompts = write_jsonl(tmp_path / f"{name}.jsonl", lines)
        out = tmp_path / f"out_{name}"
        cfg = SynthConfig(target=str(embedded_target), prompts=str(prompts), out=str(out))
        with pytest.raises(ValueError, match=rf"{name}.jsonl: no usable prompts") as e:
            synthesize(cfg, engine=object())
        assert name == "empty" or ("invalid_json" in str(e.value) and "missing_id" in str(e.value))
        assert read_manifest(out) is None


@pytest.mark.parametrize("Engine", [FakeEngine, StreamingFake])
def test_skips_multiturn_failures_and_rerun(tmp_path, embedded_target, tok_template, Engine):
    tok, template = tok_template
    prompts = write_jsonl(tmp_path / "p.jsonl", [
        {"id": "one", "domain": "d", "messages": [U("hello")]},
        {"id": "multi", "domain": "d", "messages": [S("sys"), U("q1"), A("old"), U("q2"), A("trailing")]},
        {"id": "nouser", "messages": [S("s"), A("a")]},
        {"id": "empty", "messages": [U("  ")]},
        {"id": "role", "messages": [{"role": "tool", "content": "x"}, U("u")]},
        "{not json",
        {"id": "one", "messages": [U("dup")]},
        {"messages": [U("no id")]},
        {"id": "long", "messages": [U("word " * 400)]},
        {"id": "emptyreply", "messages": [U("EMPTY please")]},
        {"id": "fails", "messages": [U("FAIL please")]},
    ])
    cfg = SynthConfig(target=str(embedded_target), prompts=str(prompts), out=str(tmp_path / "out"),
                      max_tokens=32, max_model_len=300, concurrency=3)
    eng = Engine(tok)
    out = synthesize(cfg, engine=eng)
    rows, man = read_out(out), read_manifest(out)
    assert set(rows) == {"one", "multi"}
    m = rows["multi"]["messages"]
    assert [x["role"] for x in m] == ["system", "user", "assistant", "user", "assistant"]
    assert "old" not in json.dumps(m) and "trailing" not in json.dumps(m)
    # the second turn was prompted with the target's own first answer, rendered by eyas.chat
    prompts_seen = [r.prompt_ids for call in eng.calls for r in call]
    assert render_prompt_ids(tok, m[:4], template) in prompts_seen
    assert rows["multi"]["meta"]["finish_reasons"] == ["stop", "stop"]
    assert man["skip_reasons"] == {"no_user_turn": 1, "empty_content": 1, "unknown_role": 1, "invalid_json": 1,
                                   "duplicate_id": 1, "missing_id": 1, "prompt_too_long": 1, "empty_reply": 1}
    assert man["counts"] == {"ok": 2, "failed": 1, "skipped": 8, "pending": 0, "turns": 3}
    assert man["failed_reasons"] == {"HTTP 400": 1} and man["complete"] is False
    # the re-run retries the failed row only, then completes; a third run does nothing
    eng2 = Engine(tok, fail=False)
    synthesize(cfg, engine=eng2)
    assert [len(c) for c in eng2.calls] == [1]
    assert set(read_out(out)) == {"one", "multi", "fails"} and read_manifest(out)["complete"] is True
    eng3 = Engine(tok)
    synthesize(cfg, engine=eng3)
    assert eng3.calls == []
    with pytest.raises(ValueError, match="differs in: max_tokens"):
        synthesize(SynthConfig(**{**cfg.__dict__, "max_tokens": 16}), engine=eng3)


def test_turns_last_keeps_history(tmp_path, embedded_target, tok_template):
    tok, template = tok_template
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": 7, "messages": [U("q1"), A("kept"), U("q2"), A("x")]}])
    cfg = SynthConfig(target=str(embedded_target), prompts=str(prompts), out=str(tmp_path / "out"), turns="last")
    eng = FakeEngine(tok)
    rows = read_out(synthesize(cfg, engine=eng))
    assert len(eng.calls) == 1 and eng.calls[0][0].prompt_ids == render_prompt_ids(tok, [U("q1"), A("kept"), U("q2")],
                                                                                  template)
    assert rows[7]["messages"][:3] == [U("q1"), A("kept"), U("q2")] and rows[7]["messages"][3]["content"] != "x"


def test_resume_cuts_torn_last_line(tmp_path, embedded_target, tok_template):
    tok, _ = tok_template
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"r{i}", "messages": [U(f"q{i}")]} for i in range(5)])
    cfg = SynthConfig(target=str(embedded_target), prompts=str(prompts), out=str(tmp_path / "out"), concurrency=2)
    out = synthesize(cfg, engine=FakeEngine(tok))
    # simulate a kill mid-write: the last line half written, the manifest not yet complete
    f = out / OUT_FILE
    data = f.read_bytes()
    f.write_bytes(data[: data.rfind(b"\n", 0, len(data) - 1) + 20])
    man = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**man, "complete": False}))
    eng = FakeEngine(tok)
    synthesize(cfg, engine=eng)
    assert [len(c) for c in eng.calls] == [1]  # only the torn row is redone
    assert sorted(read_out(out)) == [f"r{i}" for i in range(5)]
    # a corrupt line that is not the last one is an error, never silently dropped
    lines = f.read_text().splitlines(keepends=True)
    f.write_text(lines[0] + "{torn\n" + "".join(lines[1:]))
    with pytest.raises(ValueError, match="corrupt line"):
        scan_jsonl(f)


class FakeOpenAI(BaseHTTPRequestHandler):
    """A tiny OpenAI-compatible server: /v1/models, /tokenize, /v1/completions (503 after `die_after`)."""

    def log_message(self, *a):
        pass

    def _send(self, code: int, obj) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(200, {"data": [{"id": "fake"}]})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv = self.server
        if self.path == "/tokenize":
            ids = render_prompt_ids(srv.tok, req["messages"], srv.template) + srv.extra_ids
            return self._send(200, {"tokens": ids, "count": len(ids), "max_model_len": 2048})
        with srv.lock:
            srv.n += 1
            n = srv.n
        if n > srv.die_after:
            return self._send(503, {"error": "overloaded"})
        self._send(200, {"choices": [{"text": f"r{len(req['prompt'])}", "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": len(req["prompt"]), "completion_tokens": 2}})


@pytest.fixture
def fake_openai(tok_template):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    srv.tok, srv.template = tok_template
    srv.n, srv.die_after, srv.lock, srv.extra_ids = 0, 10**9, threading.Lock(), []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()


def test_endpoint_engine_retries_then_clear_error(tmp_path, embedded_target, fake_openai, monkeypatch, capsys):
    monkeypatch.setattr(E, "BACKOFF_S", 0.01)
    monkeypatch.setattr(E, "RETRIES", 3)
    t0 = time.monotonic()
    with pytest.raises(E.EngineError, match="unreachable.*failed 3 times"):
        E.EndpointEngine([f"http://127.0.0.1:{free_port()}"])
    assert time.monotonic() - t0 < 10
    # a server that dies mid-run: rows of finished batches stay, the CLI says what happened, a re-run resumes
    url = f"http://127.0.0.1:{fake_openai.server_address[1]}/v1"
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": i, "messages": [U(f"q{i}")]} for i in range(20)])
    sc = SynthConfig(target=str(embedded_target), prompts=str(prompts), out=str(tmp_path / "out"),
                     endpoint=[url, url], concurrency=2)  # batches of 2 * 4 * 2 = 16
    fake_openai.die_after = 16
    assert cli(sc, [], RunConfig()) == 1
    assert "unreachable" in capsys.readouterr().err
    out = tmp_path / "out"
    assert len(read_out(out)) == 16 and read_manifest(out)["complete"] is False
    fake_openai.die_after = 10**9
    assert cli(sc, [], RunConfig()) == 0
    assert sorted(read_out(out)) == list(range(20)) and read_manifest(out)["complete"] is True
    # an endpoint that renders chats differently from our template is refused
    fake_openai.extra_ids = [0]
    sc.out = str(tmp_path / "out2")
    with pytest.raises(ValueError, match="renders chats differently"):
        synthesize(sc)


# ---------------------------------------------------------------- slow: vLLM

MAX_TOKENS = 32
ROWS = [
    {"id": "capital", "domain": "general", "messages": [U("What is the capital of France?")]},
    {"id": "math", "domain": "math", "messages": [U("What is 12 times 7?"), A("an answer to replace")]},
    {"id": "sys", "domain": "general", "messages": [S("You are a terse assistant."), U("Name three colors.")]},
    {"id": "multi", "domain": "chat", "messages": [U("Hi! Who are you?"), A("x"), U("Tell me a joke.")]},
    {"id": "code", "domain": "code", "messages": [U("Write a Python function that adds two numbers.")]},
    {"id": "story", "domain": "general", "messages": [U("Write the first line of a story about a hawk.")]},
]
RENDER = [
    [U("Hello there.")],
    [S("You answer in French."), U("Hi"), A("Bonjour !"), U("How are you?")],
    [U("2+2?"), A("4"), U("and 3+3?"), A("6"), U("and 4+4?")],
]
DIRECT = r'''
import json, sys

def main():
    from vllm import LLM, SamplingParams
    a = json.load(open(sys.argv[1]))
    llm = LLM(model=a["model"], max_model_len=2048, dtype=a["dtype"], enforce_eager=True, seed=0,
              kv_cache_memory_bytes=1 << 30, disable_log_stats=True)
    sp = SamplingParams(temperature=0.0, max_tokens=a["max_tokens"])
    replies = {}
    for row in a["rows"]:  # regenerate by hand: one LLM.chat per user turn, on the target's own answers
        hist = []
        for m in row["messages"]:
            if m["role"] == "assistant":
                continue
            hist.append(m)
            if m["role"] == "user":
                hist.append({"role": "assistant", "content": llm.chat([hist], sp, use_tqdm=False)[0].outputs[0].text})
        replies[row["id"]] = hist
    one = SamplingParams(temperature=0.0, max_tokens=1)
    renders = {name: [llm.chat([c], one, use_tqdm=False, chat_template=t)[0].prompt_token_ids for c in a["render"]]
               for name, t in (("default", None), ("custom", a["custom_template"]))}
    json.dump({"replies": replies, "renders": renders}, open(sys.argv[2], "w"))

if __name__ == "__main__":
    main()
'''


def run_eyas(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "eyas", "synth", *args], start_new_session=True, **kw)


@pytest.fixture(scope="module")
def slow_inputs(tmp_path_factory, embedded_target):
    d = tmp_path_factory.mktemp("synth_slow")
    template = load_chat_template(embedded_target)
    custom = template.replace("You are a helpful AI assistant named SmolLM, trained by Hugging Face", "You are Eyas.")
    assert custom != template
    (d / "custom.jinja").write_text(custom)
    return d, write_jsonl(d / "prompts.jsonl", ROWS), custom


@pytest.fixture(scope="module")
def direct(slow_inputs, embedded_target):
    """Greedy replies and prompt ids straight from `vllm.LLM.chat` (in a subprocess)."""
    d, _, custom = slow_inputs
    (d / "direct.py").write_text(DIRECT)
    (d / "args.json").write_text(json.dumps({"model": str(embedded_target), "max_tokens": MAX_TOKENS, "rows": ROWS,
                                              "render": RENDER, "custom_template": custom,
                                              "dtype": engine_dtype()}))
    # same engine, dtype and thread layout as eyas's own engines: greedy texts are compared exactly
    subprocess.run([sys.executable, str(d / "direct.py"), str(d / "args.json"), str(d / "direct.json")], check=True,
                   timeout=600, stdout=subprocess.DEVNULL, env=vllm_env())
    return json.loads((d / "direct.json").read_text())


@pytest.fixture(scope="module")
def inproc(slow_inputs, embedded_target):
    """`eyas synth` in-process, killed (eyas.faults) half way through appending its second batch of rows,
    then re-run to the end: returns the output dir, the rows whole at the kill, the re-run's stderr and time."""
    d, prompts, _ = slow_inputs
    out = d / "inproc"
    args = ["--target", str(embedded_target), "--prompts", str(prompts), "--out", str(out),
            "--max-tokens", str(MAX_TOKENS), "--concurrency", "1", "--kv-cache-gib", "1"]
    k = 2  # concurrency 1 writes batches of 4 conversations: the second append holds the last 2, torn half way
    p = run_eyas(args, env={**os.environ, "EYAS_FAILPOINTS": f"append.torn:{k}"},
                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        err = p.communicate(timeout=600)[1]
        assert p.returncode == -signal.SIGKILL, f"not killed at append {k}: exit {p.returncode}\n{err[-3000:]}"
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    written = (out / OUT_FILE).read_bytes()
    assert not written.endswith(b"\n"), "the kill left no torn line"
    n_killed = written.count(b"\n")
    t0 = time.monotonic()
    p = run_eyas(args, stderr=subprocess.PIPE, text=True)
    err = p.communicate(timeout=600)[1]
    assert p.returncode == 0, err[-3000:]
    return out, n_killed, err, time.monotonic() - t0


@pytest.mark.slow
def test_inprocess_matches_direct_llm_chat_and_survives_kill9(inproc, direct):
    out, n_killed, err, _ = inproc
    rows, man = read_out(out), read_manifest(out)
    assert 1 <= n_killed < len(ROWS), "the kill did not land mid-run"
    assert sorted(rows) == sorted(r["id"] for r in ROWS) and man["complete"] is True
    for rid, hist in direct["replies"].items():
        assert rows[rid]["messages"] == hist, rid
    assert rows["multi"]["meta"]["finish_reasons"][0] in ("stop", "length")
    assert "tokens/s" in err
    # re-running a finished config does nothing
    p = run_eyas(["--target", man["config"]["target"], "--prompts", man["config"]["prompts"], "--out", str(out),
                  "--max-tokens", str(MAX_TOKENS), "--concurrency", "1", "--kv-cache-gib", "1"],
                 stderr=subprocess.PIPE, text=True)
    assert p.communicate(timeout=120)[1].count("nothing to do") == 1 and p.returncode == 0


@pytest.mark.slow
def test_no_engine_outlives_a_killed_synth(slow_inputs, embedded_target, tmp_path):
    """kill -9 of `eyas synth` alone (not its process group) while its vLLM engine runs: no process it
    started is left 10 s later (eyas.children's watchdog)."""
    import psutil

    _, prompts, _ = slow_inputs
    out = tmp_path / "out"
    p = run_eyas(["--target", str(embedded_target), "--prompts", str(prompts), "--out", str(out),
                  "--max-tokens", str(MAX_TOKENS), "--concurrency", "1", "--kv-cache-gib", "1"],
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t0, kids = time.monotonic(), []
        while not ((out / OUT_FILE).exists() and (out / OUT_FILE).read_bytes().count(b"\n") >= 1):
            assert p.poll() is None and time.monotonic() - t0 < 300, "synth ended before writing a row"
            kids = [c for c in psutil.Process(p.pid).children(recursive=True)
                    if "eyas.children" not in " ".join(c.cmdline())]
            time.sleep(0.2)
        assert kids, "the in-process engine started no process (nothing to check)"
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        time.sleep(10)
        left = [c for c in kids if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        for c in left:  # leave nothing behind for the next test even when this one fails
            c.kill()
        assert not left, [(c.pid, c.cmdline()[:3]) for c in left]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


@pytest.mark.slow
def test_rendering_equals_vllm_llm_chat(direct, embedded_target, slow_inputs):
    tok = load_tokenizer(embedded_target)
    for name, template in (("default", load_chat_template(embedded_target)), ("custom", slow_inputs[2])):
        assert direct["renders"][name] == [render_prompt_ids(tok, c, template) for c in RENDER], name


@pytest.fixture(scope="module")
def server(embedded_target):
    from eyas.synth.server import VllmServer

    with VllmServer(embedded_target, kv_cache_gib=1) as srv:
        yield srv


@pytest.mark.slow
def test_endpoint_matches_inprocess_and_server_renders_like_us(server, inproc, slow_inputs, embedded_target):
    d, prompts, _ = slow_inputs
    cfg = SynthConfig(target=str(embedded_target), prompts=str(prompts), out=str(d / "endpoint"),
                      max_tokens=MAX_TOKENS, endpoint=[server.url], concurrency=1)
    out = synthesize(cfg)
    ours, theirs = read_out(inproc[0]), read_out(out)
    assert {k: v["messages"] for k, v in theirs.items()} == {k: v["messages"] for k, v in ours.items()}
    assert read_manifest(out)["last_run"]["engine"] == "endpoint"
    tok, template = load_tokenizer(embedded_target), load_chat_template(embedded_target)
    eng = E.EndpointEngine([server.url])
    for conv in RENDER:
        assert eng.tokenize_chat(conv)[0] == render_prompt_ids(tok, conv, template)


# ---------------------------------------------------------------- the hf engine (no vLLM)

def _reqs(tok, n: int = 5) -> list:
    texts = ["hi", "tell me about hawks and falcons", "2+2?", "a much longer prompt " * 6, "why?"][:n]
    return [E.Request(tok(t, add_special_tokens=False)["input_ids"], max_tokens=6 + 2 * (i % 2), seed=0)
            for i, t in enumerate(texts)]


def test_hf_engine_batched_equals_one_at_a_time(tiny_llama):
    """Left-padded batches of 3 give every request the ids it gets alone (float32)."""
    from eyas.synth.hf import HFEngine

    one = HFEngine(tiny_llama, dtype="fp32", batch=1)
    reqs = _reqs(one.tok)
    alone = one.generate_ids(reqs)
    batched = HFEngine(tiny_llama, dtype="fp32", batch=3).generate_ids(reqs)
    assert batched == alone
    assert [len(ids) for ids, why in alone if why == "length"] == [r.max_tokens for r, (_, why) in zip(reqs, alone)
                                                                     if why == "length"]
    with pytest.raises(ValueError, match="greedily only"):
        one.generate(reqs, E.Sampling(temperature=0.7))


def test_hf_engine_synthesizes_and_records_itself(tmp_path, tiny_llama):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"r{i}", "messages": [U(f"question {i}?")]} for i in range(5)]
                          + [{"id": "two", "messages": [U("first"), A("x"), U("second")]}])
    cfg = SynthConfig(target=str(tiny_llama), prompts=str(prompts), out=str(tmp_path / "out"), max_tokens=8,
                      engine="hf", dtype="fp32", concurrency=4, max_model_len=256)
    out = synthesize(cfg)
    rows, man = read_out(out), read_manifest(out)
    assert sorted(rows) == ["r0", "r1", "r2", "r3", "r4", "two"] and man["complete"]
    assert [m["role"] for m in rows["two"]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert man["key"]["engine"] == "hf" and man["key"]["dtype"] == "fp32"
    assert man["last_run"]["engine"] == "hf" and man["last_run"]["dtype"] == "float32"
    with pytest.raises(ValueError, match="greedily only"):
        synthesize(SynthConfig(**{**cfg.__dict__, "temperature": 0.5, "out": str(tmp_path / "o2")}))


@pytest.mark.slow
def test_hf_engine_replies_equal_vllm_float32(slow_inputs, embedded_target, tmp_path):
    """`eyas synth --engine hf --dtype fp32` (batches of 3, left-padded) writes the replies vLLM float32
    writes for the same single-turn prompts, token for token (the same prompt ids: eyas.chat renders both)."""
    from eyas import vllm_runner

    _, prompts, _ = slow_inputs
    single = [r for r in ROWS if sum(m["role"] == "user" for m in r["messages"]) == 1]
    spec = {"target": str(embedded_target), "max_tokens": MAX_TOKENS, "kv_cache_gib": 1, "dtype": "float32",
            "batches": [{"name": "hf", "conversations": [[m for m in r["messages"] if m["role"] != "assistant"]
                                                         for r in single]}]}
    want = dict(zip([r["id"] for r in single], vllm_runner.run(spec, timeout=600)["batches"][0]["texts"]))
    out = tmp_path / "hf"
    p = run_eyas(["--target", str(embedded_target), "--prompts", str(prompts), "--out", str(out), "--engine", "hf",
                  "--dtype", "fp32", "--concurrency", "3", "--max-tokens", str(MAX_TOKENS)],
                 stderr=subprocess.PIPE, text=True)
    assert p.wait(timeout=600) == 0, p.stderr.read()[-3000:]
    rows = read_out(out)
    assert {i: rows[i]["messages"][-1]["content"] for i in want} == want


def test_a_time_budget_stops_between_batches_and_a_larger_one_continues(tmp_path, embedded_target, tok_template):
    """Turn by turn (an engine without `stream`) the budget is checked before each batch of 4 x concurrency
    conversations and before each later turn (a batch's conversations then end with the turns they have).
    A run its budget stopped is complete for that budget; another budget (0: none) continues."""
    tok, _ = tok_template

    class Slow(FakeEngine):
        def generate(self, reqs, sampling, on_done=None):
            time.sleep(0.2)
            return super().generate(reqs, sampling, on_done)

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"r{i}", "messages": [U(f"q{i}"), A("a"), U("more")]}
                                                  for i in range(12)])
    cfg = SynthConfig(target=str(embedded_target), prompts=str(prompts), out=str(tmp_path / "out"), concurrency=1,
                      max_seconds=0.1)  # batches of 4 conversations: the first runs, then the budget is spent
    eng = Slow(tok)
    out = synthesize(cfg, engine=eng)
    man = read_manifest(out)
    assert len(eng.calls) == 1 and man["counts"]["ok"] == 4 and man["counts"]["pending"] == 8  # turn 2 never ran
    assert all(r["meta"]["stopped"] == "budget" and len(r["meta"]["finish_reasons"]) == 1 for r in read_out(out).values())
    assert man["complete"] and man["budget"] == {"max_seconds": 0.1, "spent": True}
    assert not (out / "skipped.jsonl").exists() or not (out / "skipped.jsonl").read_text().strip()
    synthesize(cfg, engine=(eng1 := Slow(tok)))  # the same budget: done
    assert not eng1.calls
    eng2 = Slow(tok)
    synthesize(SynthConfig(**{**cfg.__dict__, "max_seconds": 0}), engine=eng2)  # the budget is not in the key
    assert len(eng2.calls) == 4 and sorted(read_out(out)) == sorted(f"r{i}" for i in range(12))  # 2 batches x 2 turns
    assert all(len(r["meta"]["finish_reasons"]) == 2 for i, r in read_out(out).items() if i not in ("r0", "r1", "r2", "r3"))
    man = read_manifest(out)
    assert man["complete"] and man["budget"] is None and man["counts"]["pending"] == 0


def test_a_time_budget_is_checked_as_each_conversation_would_start(tmp_path, embedded_target, tok_template):
    """Continuous turns: once the budget is spent no reply starts. The replies in the engine finish, and a
    conversation whose later turn was still to come ends there (stopped "budget", written with the turns it
    has); the unstarted ones are neither written nor counted as skipped; a larger budget continues with them."""
    tok, _ = tok_template

    class Slow(StreamingFake):
        def generate(self, reqs, sampling, on_done=None):
            time.sleep(0.05)
            return super().generate(reqs, sampling, on_done)

    rows = [{"id": f"r{i}", "messages": [U(f"q{i}"), A("a"), U(f"again {i}")]} for i in range(20)]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    cfg = SynthConfig(target=str(embedded_target), prompts=str(prompts), out=str(tmp_path / "out"), concurrency=8,
                      max_seconds=0.12)  # one batch of 20 conversations; 3 slots of 0.05 s replies
    out = synthesize(cfg, engine=(eng := Slow(tok)))
    got, man = read_out(out), read_manifest(out)
    turns = {i: len(r["meta"]["finish_reasons"]) for i, r in got.items()}
    assert 3 <= len(got) < 20 and set(turns.values()) <= {1, 2}
    assert all((got[i]["meta"]["stopped"] == "budget") == (n == 1) for i, n in turns.items())
    assert 1 in turns.values()  # the budget fell while first turns were in the engine: their second never began
    assert man["complete"] and man["budget"]["spent"] and man["counts"]["pending"] == 20 - len(got)
    assert man["counts"]["skipped"] == 0 and not (out / "skipped.jsonl").exists()
    assert len(eng.calls) == sum(turns.values())  # nothing started that was not finished
    synthesize(SynthConfig(**{**cfg.__dict__, "max_seconds": 60}), engine=Slow(tok))
    assert sorted(read_out(out)) == sorted(r["id"] for r in rows) and read_manifest(out)["counts"]["pending"] == 0


def test_continuous_turns_write_in_input_order_as_conversations_finish(tmp_path, embedded_target, tok_template,
                                                                       monkeypatch):
    """One stream over every conversation (no batch boundary where the engine drains): conversations finish
    out of order (three slots, round robin, one to three turns each) and are written in input order, each
    once those before it are, so a kill loses at most the ones behind an unfinished conversation."""
    import eyas.synth as synth_mod

    tok, _ = tok_template
    rows = [{"id": f"r{i}", "messages": [U(f"q{i}")] + [A("a"), U("more")] * (i % 3)} for i in range(30)]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    sizes, real_append = [], synth_mod.append_jsonl

    def append(path, records):
        if records and Path(path).name == OUT_FILE:
            sizes.append(len(records))
        real_append(path, records)

    monkeypatch.setattr(synth_mod, "append_jsonl", append)
    out = synthesize(SynthConfig(target=str(embedded_target), prompts=str(prompts), out=str(tmp_path / "out"),
                                 concurrency=2), engine=StreamingFake(tok, fail=False))
    ids = [json.loads(x)["id"] for x in (out / OUT_FILE).read_text().splitlines()]
    assert ids == [r["id"] for r in rows]  # input order, though 4 x concurrency = 8 is no longer a batch
    assert len(sizes) > 30 // 8 + 1  # written as they finished, not in batches of 8
    assert {len(r["meta"]["finish_reasons"]) for r in read_out(out).values()} == {1, 2, 3}
