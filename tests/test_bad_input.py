"""Bad input through the CLI, as a user meets it: each case exits 2 with one line that names the
file (or field) and what to do, writes nothing where it should not, and shows no traceback. A
failure that is not the user's (an eyas bug) exits 1 with its traceback, said to be a bug."""

from __future__ import annotations

import json
import shutil
import socket

import pytest

from eyas.cli import main
from eyas.lock import is_lock_name


def _fails(capsys, argv: list[str], *needles: str) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, (rc, err[-2000:])
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"eyas {argv[0]}: error: "), err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    for n in needles:
        assert n in line, (n, line)
    return line


def _prompts(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# One kind of bad input per row: argv (W = a scratch dir holding the files below, T = the tiny target)
# and what the one error line must name. None of these starts an engine.
TABLE = {
    "target that does not exist": (["synth", "--target", "W/nope", "--prompts", "W/p.jsonl", "--out", "W/o"],
                                   ["W/nope"]),
    "target dir without config.json": (["extract", "--target", "W/noconfig", "--data", "W/conv.jsonl", "--out", "W/o"],
                                       ["W/noconfig", "config.json"]),
    "target config.json not JSON": (["extract", "--target", "W/badcfg", "--data", "W/conv.jsonl", "--out", "W/o"],
                                    ["W/badcfg/config.json"]),
    "prompts line not JSON": (["synth", "--target", "T", "--prompts", "W/nj.jsonl", "--out", "W/o"],
                              ["W/nj.jsonl", "invalid_json"]),
    "prompts without messages": (["synth", "--target", "T", "--prompts", "W/nomsg.jsonl", "--out", "W/o"],
                                 ["W/nomsg.jsonl", "no_messages"]),
    "prompts with an unknown role": (["synth", "--target", "T", "--prompts", "W/badrole.jsonl", "--out", "W/o"],
                                     ["W/badrole.jsonl", "unknown_role"]),
    "negative temperature": (["synth", "--target", "T", "--prompts", "W/p.jsonl", "--out", "W/o",
                              "--temperature", "-1"],
                             ["synth.temperature", ">= 0"]),
    "a word for a number": (["synth", "--target", "T", "--prompts", "W/p.jsonl", "--out", "W/o", "--max-tokens", "abc"],
                            ["synth.max_tokens", "expected int"]),
    "layer id past the target's depth": (["extract", "--target", "T", "--data", "W/conv.jsonl", "--out", "W/o",
                                          "--layer-ids", "1", "2", "99"], ["[99]", "outside"]),
    "a dir where a data file goes": (["extract", "--target", "T", "--data", "W", "--out", "W/o"], ["W", "directory"]),
    "features that do not exist": (["train", "--target", "T", "--features", "W/nofeat", "--out", "W/o"],
                                   ["W/nofeat", "eyas extract"]),
    "features dir without a manifest": (["train", "--target", "T", "--features", "W/empty", "--out", "W/o"],
                                        ["W/empty", "eyas extract"]),
    "lr 0": (["train", "--target", "T", "--features", "W/empty", "--out", "W/o", "--lr", "0"], ["train.lr", "> 0"]),
    "TTT steps 0": (["train", "--target", "T", "--features", "W/empty", "--out", "W/o", "--ttt-steps", "0"],
                    ["train.ttt_steps", "> 0"]),
    "export of a dir that is not a run": (["export", "--run", "W/empty", "--out", "W/x"],
                                          ["W/empty", "training run dir"]),
    "eval of a draft that does not exist": (["eval", "--target", "T", "--draft", "W/nodraft", "--prompts", "W/p.jsonl"],
                                            ["W/nodraft/config.json"]),
    "a bad n-gram spec": (["eval", "--target", "T", "--draft", "ngram:5:2", "--prompts", "W/p.jsonl"],
                          ["ngram:5:2", "MIN <= MAX"]),
    "unknown data source": (["data", "fetch", "no_such_source"], ["no_such_source", "known sources"]),
    "data stats of a missing file": (["data", "stats", "W/nope.jsonl"], ["W/nope.jsonl"]),
    "unknown model": (["models", "fetch", "no-such-model"], ["no-such-model", "known"]),
    "recipe key misspelt": (["config", "--recipe", "W/r_key.yaml"], ["r_key.yaml:train", "'lrr'", "valid keys"]),
    "recipe section misspelt": (["config", "--recipe", "W/r_sec.yaml"], ["W/r_sec.yaml", "'trian'", "valid sections"]),
    "recipe not YAML": (["config", "--recipe", "W/r_yaml.yaml"], ["W/r_yaml.yaml:2:1", "not valid YAML"]),
    "recipe a list": (["config", "--recipe", "W/r_list.yaml"], ["W/r_list.yaml", "mapping of sections"]),
    "recipe value of the wrong type": (["config", "--recipe", "W/r_type.yaml"],
                                       ["r_type.yaml:train.lr", "expected float"]),
    "unknown recipe": (["run", "--recipe", "no_such_recipe"], ["no_such_recipe", "known recipes"]),
    "override without =": (["config", "--recipe", "demo", "train.lr"], ["train.lr", "section.key=value"]),
    "override of an unknown key": (["config", "--recipe", "demo", "train.nope=1"], ["'nope'", "valid keys"]),
    "run --out is a file": (["run", "--recipe", "demo", "--out", "W/conv.jsonl"], ["W/conv.jsonl", "another --out"]),
    "unknown benchmark": (["bench", "nosuch"], ["nosuch", "choose one of"]),
    "an action a stage does not take": (["export", "--run", "W/empty", "now"], ["takes no actions"]),
}


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, tiny_llama):
    w = tmp_path_factory.mktemp("bad")
    user = {"role": "user", "content": "hi"}
    _prompts(w / "p.jsonl", [{"id": "a", "messages": [user]}])
    _prompts(w / "conv.jsonl", [{"id": "a", "messages": [user, {"role": "assistant", "content": "hello there"}]}])
    _prompts(w / "nomsg.jsonl", [{"id": "a", "text": "hi"}])
    _prompts(w / "badrole.jsonl", [{"id": "a", "messages": [{"role": "wizard", "content": "hi"}]}])
    (w / "nj.jsonl").write_text('{"id": "a", "messages": [\n')
    for name, text in (("r_key", "train:\n  lrr: 0.1\n"), ("r_sec", "trian:\n  lr: 0.1\n"), ("r_yaml", "train: [\n"),
                       ("r_list", "- a\n- b\n"), ("r_type", "train:\n  lr: fast\n")):
        (w / f"{name}.yaml").write_text(text)
    (w / "empty").mkdir()
    (w / "noconfig").mkdir()
    (w / "noconfig" / "model.safetensors").write_bytes(b"")
    shutil.copytree(tiny_llama, w / "badcfg")
    (w / "badcfg" / "config.json").write_text("{")
    return w


@pytest.mark.parametrize("case", sorted(TABLE))
def test_bad_input_table(case, bad_files, tiny_llama, capsys):
    argv, needles = TABLE[case]

    def fill(a: str) -> str:
        return str(tiny_llama) if a == "T" else str(bad_files) + a[1:] if a == "W" or a.startswith("W/") else a

    def files() -> list[str]:  # eyas's lock files (`.NAME.lock` beside an output, eyas.lock) are not output
        return sorted(p.name for p in bad_files.rglob("*") if not is_lock_name(p.name))

    before = files()
    _fails(capsys, [fill(a) for a in argv], *[fill(n) if n.startswith("W") else n for n in needles])
    assert files() == before, "a refused command wrote or removed files"


def test_missing_and_non_utf8_inputs(tmp_path, capsys, tiny_llama):
    missing = tmp_path / "nope.jsonl"
    _fails(capsys, ["synth", "--target", str(tiny_llama), "--prompts", str(missing), "--out", str(tmp_path / "s")],
           str(missing), "No such file")
    _fails(capsys, ["eval", "--target", str(tiny_llama), "--draft", "ngram", "--prompts", str(missing)], str(missing))
    assert not (tmp_path / "s").exists()

    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes(b'{"id": "a", "messages": [{"role": "user", "content": "ok"}]}\n'
                      b'{"id": "b", "messages": [{"role": "user", "content": "caf\xe9"}]}\n')
    _fails(capsys, ["eval", "--target", str(tiny_llama), "--draft", "ngram", "--prompts", str(latin)],
           f"{latin}:2", "utf-8")
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(b"run:\n  out: caf\xe9\n")
    _fails(capsys, ["config", "--recipe", str(recipe)], f"{recipe}:2", "not UTF-8")


def test_unwritable_out_and_out_of_range_numbers(tmp_path, capsys, tiny_llama):
    conv = _prompts(tmp_path / "conv.jsonl", [{"id": "a", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}])
    blocker = tmp_path / "file"
    blocker.write_text("mine")
    out = blocker / "feats"  # a file where a directory must go: not writable for root either
    _fails(capsys, ["extract", "--target", str(tiny_llama), "--data", conv, "--out", str(out)], str(blocker))
    assert blocker.read_text() == "mine"
    _fails(capsys, ["train", "--target", str(tiny_llama), "--features", str(tmp_path), "--out", str(tmp_path / "t"),
                    "--threads", "-1"], "train.threads", ">= 0")


def test_damaged_target_and_draft_files_are_named(tmp_path, capsys, tiny_llama):
    conv = _prompts(tmp_path / "conv.jsonl", [{"id": "a", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}])
    target = tmp_path / "target"
    shutil.copytree(tiny_llama, target)
    w = target / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])  # a download cut off half way
    _fails(capsys, ["extract", "--target", str(target), "--data", conv, "--out", str(tmp_path / "f"),
                    "--compute-dtype", "fp32"], str(w), "not a readable safetensors file")

    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{'architectures': ['Eagle3")  # not JSON
    prompts = _prompts(tmp_path / "p.jsonl", [{"id": "a", "messages": [{"role": "user", "content": "hi"}]}])
    _fails(capsys, ["eval", "--target", str(tiny_llama), "--draft", str(draft), "--prompts", prompts],
           str(draft / "config.json"), "not valid JSON")


def test_busy_streaming_port_is_named(tmp_path, capsys, tiny_llama):
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    try:
        _fails(capsys, ["train", "--target", str(tiny_llama), "--source", "streaming",
                        "--features", f"tcp://127.0.0.1:{port}?producers=1", "--out", str(tmp_path / "t"),
                        "--max-steps", "1", "--no-progress"], f"127.0.0.1:{port}", "choose another port")
    finally:
        s.close(linger=0)
        ctx.term()
    with socket.socket() as busy:  # the OSError path: one line with the errno's fix
        busy.bind(("127.0.0.1", 0))
        from eyas.cli import os_error_line

        try:
            socket.socket().bind(busy.getsockname())
        except OSError as e:
            assert "the port is in use" in os_error_line(e)


def test_an_eyas_bug_is_a_traceback_said_to_be_one(capsys, monkeypatch):
    import eyas.data

    def broken(*a, **k):
        return {}["no such key"]

    monkeypatch.setattr(eyas.data, "cli", broken)
    assert main(["data", "stats", "x"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError" in err and "this is a bug in eyas" in err


@pytest.mark.slow
def test_vllm_refusing_a_target_is_one_line(tmp_path, capsys, tiny_llama):
    """A target vLLM cannot run here (this tiny llama's head_dim 16 has no CPU attention kernel): synthesis
    says so in one line naming the target, not as an eyas bug."""
    prompts = _prompts(tmp_path / "p.jsonl", [{"id": "a", "messages": [{"role": "user", "content": "hi"}]}])
    _fails(capsys, ["synth", "--target", str(tiny_llama), "--prompts", prompts, "--out", str(tmp_path / "s"),
                    "--kv-cache-gib", "1"], "vLLM could not run the target", str(tiny_llama))
