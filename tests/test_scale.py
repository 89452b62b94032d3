"""Prompts for millions of tokens (eyas.scale, #32): every shipped source at full size, none of the recipes'
held-out prompts and none of the SPEED-shaped suite's, shuffled so that any prefix samples every source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eyas.data.normalize import make_record
from eyas.data.split import split
from eyas.io import iter_jsonl
from eyas.scale import PLACEHOLDER, build_scale_prompts, first_user_turns

U = lambda s: {"role": "user", "content": s}  # noqa: E731
A = lambda s: {"role": "assistant", "content": s}  # noqa: E731


def _read(path: Path) -> list[dict]:
    return [r for _, r in iter_jsonl(path)]


def test_first_user_turns_keeps_n_and_placeholders_the_replies():
    msgs = [{"role": "system", "content": "s"}, U("a"), A("long reply"), U("b"), A("x"), U("c"), A("y")]
    assert first_user_turns(msgs, 2) == [msgs[0], U("a"), A(PLACEHOLDER), U("b")]
    assert first_user_turns(msgs, 9)[-1] == U("c")


def test_held_out_prompts_stay_out_and_the_order_mixes_sources(tmp_path):
    recs = {s: [make_record(s, "d", [U(f"{s} question {i}"), A("r"), U(f"{s} more {i}")]) for i in range(300)]
            for s in ("one", "two")}
    man = build_scale_prompts(tmp_path, max_user_turns=1, reserve_depth=0, min_prompts=10, sources=recs)
    got = _read(tmp_path / "prompts.jsonl")
    held = {r["id"] for rs in recs.values() for r in split(rs, 0.05, 0)[1]}
    assert held and not held & {r["id"] for r in got}
    assert man["prompts"] == len(got) == 600 - len(held) and man["dropped"] == {"held_out": len(held)}
    assert all(r["messages"] == [U(r["messages"][0]["content"])] for r in got)  # one user turn each
    first = [r["meta"]["source"] for r in got[:40]]
    assert 10 < first.count("one") < 30  # a prefix samples both sources
    with pytest.raises(ValueError, match="only 570 prompts survive|only .* prompts survive"):
        build_scale_prompts(tmp_path / "x", reserve_depth=0, min_prompts=10_000, sources=recs)


def test_the_shipped_file_keeps_out_the_suite_and_the_recipes_eval_prompts(tmp_path):
    """The real build: >= 30,000 prompts; no prompt of the suite as `eyas bench al` builds it against the demo's
    training split, and no eval prompt of the demo or full recipe, by id or by user-turn text."""
    from eyas.bench.suite import build_suite
    from eyas.config import load_recipe
    from eyas.data import build_mix

    man = build_scale_prompts(tmp_path / "scale")
    got = _read(tmp_path / "scale" / "prompts.jsonl")
    assert man["prompts"] == len(got) >= 30_000 and len({r["id"] for r in got}) == len(got)
    ids = {r["id"] for r in got}
    texts = {" ".join(m["content"].split()) for r in got for m in r["messages"] if m["role"] == "user"}

    def outside(recs: list[dict]) -> bool:
        return not any(r["id"] in ids or any(" ".join(m["content"].split()) in texts
                                             for m in r["messages"] if m["role"] == "user") for r in recs)

    for name in ("demo", "full"):
        d = load_recipe(name).data
        mix = build_mix(d.sources, d.max_per_source, d.seed, tmp_path / name, d.eval_fraction)
        assert outside(_read(mix["eval"])), name
    demo_train = tmp_path / "demo" / "train.jsonl"
    suite, _ = build_suite(40, [demo_train])
    assert len(suite) == 9 * 40 and outside(suite)


@pytest.mark.slow
def test_the_gpu_run_in_miniature_on_the_cpu(tmp_path, tiny_llama):
    """scripts/gpu_scale.py end to end on a CPU (the rehearsal of the GPU command): every stage inside the
    budget, the training steps set from the probe, a servable draft and the packed parts."""
    import gzip
    import subprocess
    import sys

    rows = [make_record("t", "d", [U(f"tell me about topic {i}")]) for i in range(24)]
    prompts = tmp_path / "p.jsonl.gz"
    with gzip.open(prompts, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    out, pack = tmp_path / "g", tmp_path / "pack"
    res = subprocess.run([sys.executable, "scripts/gpu_scale.py", "--target", str(tiny_llama), "--prompts", str(prompts),
                          "--out", str(out), "--device", "cpu", "--budget-s", "90", "--batch", "8", "--max-tokens", "8",
                          "--max-model-len", "256", "--token-budget", "256", "--draft-vocab-size", "256",
                          "--probe-steps", "3", "--reserve-s", "10", "--extract-batch-tokens", "2048",
                          "--pack", str(pack)], capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr[-3000:]
    t = json.loads((out / "timings.json").read_text())
    assert t["synth"]["ok"] == 24 and t["extract"]["samples"] == 24 and t["train"]["steps"] >= 3
    assert t["total_s"] < 90 + 30  # the budget, with what a stage over its share may add
    assert json.loads((out / "draft" / "manifest.json").read_text())["complete"]
    assert sorted(p.name for p in pack.iterdir()) == ["gpu_scale.tar.gz.00"]
