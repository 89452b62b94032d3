"""eyas.stage: one rule for where every stage writes, when it skips, and what it refuses."""

import json

import pytest

from eyas.manifest import write_manifest
from eyas.stage import claim, output_dir


def test_output_dir_names_the_flag():
    with pytest.raises(ValueError, match="no output dir: pass --out DIR"):
        output_dir("", "--out")
    assert output_dir("~/x", "--out").name == "x"


def test_claim(tmp_path):
    new = claim(tmp_path / "missing", "synth", {"a": 1})
    assert new.manifest is None and not new.complete
    (tmp_path / "empty").mkdir()
    assert claim(tmp_path / "empty", "synth", {"a": 1}).manifest is None
    (tmp_path / "empty" / ".x.tmp.123").write_text("")  # eyas's own temp names are not foreign content
    assert claim(tmp_path / "empty", "synth", {"a": 1}).manifest is None

    mine = tmp_path / "mine"
    write_manifest(mine, "synth", None, key={"a": 1, "b": 2}, complete=True)
    assert claim(mine, "synth", {"a": 1, "b": 2}).complete
    with pytest.raises(ValueError, match=r"different settings \(differs in: b\)"):
        claim(mine, "synth", {"a": 1, "b": 3})
    assert claim(mine, "synth", {"a": 1, "b": 3}, on_change="replace").manifest is None
    with pytest.raises(ValueError, match="holds an eyas 'synth' output, not an eyas export output"):
        claim(mine, "export", {"a": 1})

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"not empty and is not an eyas export output \(it holds notes.txt\)"):
        claim(foreign, "export", {}, on_change="replace")


def test_export_refuses_a_foreign_dir_and_skips_a_done_one(tiny_llama, tmp_path, monkeypatch, capsys):
    from eyas import export
    from eyas.draft.contract import random_draft

    state, cfg = random_draft(tiny_llama, draft_vocab_size=512)
    meta = {"draft_config": cfg, "layer_ids": cfg["eagle_aux_hidden_state_layer_ids"], "target": str(tiny_llama)}
    monkeypatch.setattr(export, "load_draft_state", lambda p: (state, meta))
    ckpt = tmp_path / "run" / "checkpoints" / "step_1"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer.json").write_text(json.dumps({"step": 1}))
    foreign = tmp_path / "work"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("years of work")
    with pytest.raises(ValueError, match="not an eyas export output"):
        export.export_checkpoint(ckpt, foreign)
    assert (foreign / "thesis.tex").read_text() == "years of work"

    out = export.export_checkpoint(ckpt, tmp_path / "draft")
    first = (out / "manifest.json").read_text()
    export.export_checkpoint(ckpt, tmp_path / "draft")
    assert "is complete for these inputs" in capsys.readouterr().err
    assert (out / "manifest.json").read_text() == first  # skipped: not rewritten
    (ckpt / "trainer.json").write_text(json.dumps({"step": 1, "resaved": True}))  # new content: exported again
    export.export_checkpoint(ckpt, tmp_path / "draft", dtype="fp8")
    assert json.loads((out / "manifest.json").read_text())["key"]["dtype"] == "fp8"


def test_feature_writer_keeps_what_it_did_not_write(tmp_path):
    from eyas.features import FeatureWriter

    d = tmp_path / "feat"
    d.mkdir()
    (d / "shard-00000.safetensors").write_bytes(b"someone else's")
    header = {"layer_ids": [1, 2, 3], "dtype": "bf16", "hidden_size": 8, "num_target_layers": 4}
    with pytest.raises(ValueError, match="not an eyas extract output"):
        FeatureWriter(d, header)
    assert (d / "shard-00000.safetensors").read_bytes() == b"someone else's"
    w = FeatureWriter(tmp_path / "new", header)  # a new dir gets its manifest before any shard
    assert json.loads((tmp_path / "new" / "manifest.json").read_text())["complete"] is False
    (tmp_path / "new" / "shard-00000.safetensors").write_bytes(b"torn")  # a kill between shard and manifest
    assert FeatureWriter(tmp_path / "new", header).removed == ["shard-00000.safetensors"]
    assert w.shards == []


def test_run_refuses_a_foreign_out_before_any_stage(tmp_path):
    from eyas.cli import main

    (tmp_path / "notes.txt").write_text("mine")
    assert main(["run", "--out", str(tmp_path), "models.check=false"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_lengths_travel_with_the_artifacts(tmp_path):
    """extract.max_len and train.max_len default to what made their input (one definition: synth's)."""
    from eyas.config import ExtractConfig, SynthConfig, TrainConfig
    from eyas.extract.base import resolve_lengths as extract_lengths
    from eyas.train.loop import resolve_lengths as train_lengths

    synth = tmp_path / "synth"
    write_manifest(synth, "synth", SynthConfig(max_model_len=300), complete=True)
    conv = synth / "conversations.jsonl"
    assert extract_lengths(ExtractConfig(data=str(conv))).max_len == 300
    assert extract_lengths(ExtractConfig(data=str(conv), max_len=100)).max_len == 100  # given wins
    assert extract_lengths(ExtractConfig(data=str(tmp_path / "mine.jsonl"))).max_len == 2048  # not eyas-made
    feats = tmp_path / "feats"
    write_manifest(feats, "extract", None, max_len=300, complete=True)
    assert train_lengths(TrainConfig(features=str(feats))).max_len == 300
    assert train_lengths(TrainConfig(features=str(conv), source="online")).max_len == 300
    assert train_lengths(TrainConfig(features="tcp://x:1", source="streaming")).max_len == 2048


def test_eyas_run_sets_a_changed_stage_aside(tmp_path):
    """Inside its run dir, `eyas run` moves a stage's output made with other settings to
    RUN/superseded/<time>/ (nothing deleted) and runs the stage again; outside it, the refusal stands."""
    from eyas.pipeline import again_if_changed
    from eyas.stage import ChangedOutput

    run = (tmp_path / "run").resolve()
    write_manifest(run / "synth", "synth", None, key={"max_tokens": 12}, complete=True)
    (run / "synth" / "conversations.jsonl").write_text("old\n")
    calls = []

    def synth():
        calls.append(1)
        return claim(run / "synth", "synth", {"max_tokens": 10})

    assert again_if_changed(run, synth).manifest is None and len(calls) == 2
    moved = list((run / "superseded").glob("*/synth/conversations.jsonl"))
    assert [p.read_text() for p in moved] == ["old\n"]

    other = tmp_path / "elsewhere"
    write_manifest(other, "synth", None, key={"max_tokens": 12}, complete=True)
    with pytest.raises(ChangedOutput, match="differs in: max_tokens"):
        again_if_changed(run, lambda: claim(other, "synth", {"max_tokens": 10}))
    assert (other / "manifest.json").exists()
