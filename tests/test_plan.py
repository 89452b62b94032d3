"""`eyas run --plan`: what each stage would do in a run dir and what it would make, nothing started or written."""

from __future__ import annotations

import time

from test_synth import FakeEngine

from eyas.cli import main
from eyas.config import SynthConfig, read_recipe


def _plan(capsys, out, *extra) -> dict[str, str]:
    assert main(["run", "--recipe", "demo", "--plan", "--out", str(out), *extra]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"eyas run --plan: {out}")
    return {ln.split()[0]: ln.split(None, 1)[1] for ln in lines[1:]}


def test_plan_of_a_fresh_run_dir_writes_nothing(tmp_path, capsys, embedded_target):
    out = tmp_path / "run"
    p = _plan(capsys, out)
    assert not out.exists() and not (tmp_path / ".run.lock").exists()
    assert list(p) == ["target", "data", "synth", "extract", "train", "export", "eval", "bench"]
    assert "on disk (hidden 576, 30 layers)" in p["target"]
    assert p["data"].startswith("to do: 4 sources") and "upper bound" in p["data"]
    assert p["synth"].startswith("to do; <= 560 conversations")
    assert "<= 430,080 tokens" in p["extract"] and "x 4 states x hidden 576 x 2 bytes = <= 1.98 GB" in p["extract"]
    t = read_recipe("demo").train
    assert f"{t.max_steps} steps x {t.token_budget} tokens" in p["train"] and p["train"].startswith("to do")
    assert "run.max_minutes" not in p["train"]
    p = _plan(capsys, out, "run.max_minutes=30", "run.reserve_minutes=9")
    assert "at most what is left of run.max_minutes 30 when it starts, less run.reserve_minutes 9" in p["train"]


def test_plan_of_a_half_done_run_dir(tmp_path, capsys, embedded_target):
    """Data mixed, synthesis stopped half way: the plan counts the prompts, says synthesis resumes with what
    is pending, bounds the features from the counted conversations; a changed recipe says what is set aside."""
    from eyas.data import build_mix
    from eyas.synth import synthesize

    from eyas.chat import load_tokenizer

    out = tmp_path / "run"
    d = read_recipe("demo").data
    paths = build_mix(["humaneval"], 12, d.seed, out / "data", d.eval_fraction)

    class Slow(FakeEngine):
        def generate(self, reqs, sampling, on_done=None):
            time.sleep(0.2)
            return super().generate(reqs, sampling, on_done)

    s = read_recipe("demo").synth
    cfg = SynthConfig(**{**s.__dict__, "target": str(embedded_target), "prompts": str(paths["train"]),
                         "out": str(out / "synth"), "concurrency": 1, "max_seconds": 0.1})
    synthesize(cfg, engine=Slow(load_tokenizer(embedded_target)))
    p = _plan(capsys, out, "data.sources=[humaneval]", "data.max_per_source=12")
    n = len(paths["train"].read_text().splitlines())
    assert p["data"].startswith(f"done: skipped; {n} train") and "(counted)" in p["data"]
    assert p["synth"].startswith("partial: resumes") and f"{n} conversations, {n} replies x <= 128" in p["synth"]
    assert f"there now: 4 done, {n - 4} pending" in p["synth"]
    assert f"<= {n * 768:,} tokens ({n} conversations x max_len 768)" in p["extract"]
    p = _plan(capsys, out, "data.sources=[humaneval]", "data.max_per_source=12", "synth.max_tokens=64")
    assert p["synth"].startswith("made with other settings (max_tokens): set aside")


def test_a_recipe_with_its_own_prompts_mixes_nothing(tmp_path):
    """synth.prompts and eval.prompts set: `eyas run` synthesizes from them (no data mix); one of them set: the
    mix gives the other; no sources and no prompts: a clear error."""
    from eyas.pipeline import _prompts

    cfg = read_recipe("demo")
    own, held = tmp_path / "mine.jsonl", tmp_path / "held.jsonl"
    own.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n')
    held.write_text(own.read_text())
    cfg.synth.prompts, cfg.eval.prompts = str(own), str(held)
    assert _prompts(cfg, tmp_path / "run") == (own, held) and not (tmp_path / "run").exists()
    cfg.eval.prompts, cfg.data.sources = "", []
    import pytest

    with pytest.raises(ValueError, match="data.sources is empty"):
        _prompts(cfg, tmp_path / "run")
