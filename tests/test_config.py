from pathlib import Path
import subprocess
import sys

import pytest

from eyas import config as C
from eyas.cli import main


def test_defaults_and_recipe():
    assert C.Recipe().train.ttt_steps == 7  # the field's default (DESIGN.md: 7 TTT steps)
    cfg = C.load_recipe("demo")
    assert cfg.train.ttt_steps == 3 and cfg.extract.backend == "vllm"  # what recipes/demo.yaml says
    assert cfg.run.target == "smollm2-135m-instruct"
    assert isinstance(cfg.train.lr, float)


def test_overrides_typed():
    cfg = C.load_recipe("demo", ["train.max_steps=12", "train.lr=3e-4", "synth.endpoint=http://a,http://b", "train.resume=true"])
    assert cfg.train.max_steps == 12 and cfg.train.lr == pytest.approx(3e-4)
    assert cfg.synth.endpoint == ["http://a", "http://b"]
    assert cfg.train.resume is True


@pytest.mark.parametrize(
    "override,needle",
    [
        ("train.no_such_key=1", "valid keys of this section: target, features"),
        ("nosection.x=1", "unknown section 'nosection'"),
        ("train.max_steps=abc", "train.max_steps: expected int"),
        ("train.resume=maybe", "expected true/false"),
        ("max_steps=3", "must name its section"),
        ("train.lr=0", "train.lr: 0.0 must be > 0"),
        ("data.max_per_source=-3", "data.max_per_source: -3 must be >= 0"),
        ("bench.concurrency=1,0", "bench.concurrency: 0 must be > 0"),
        ("data.eval_fraction=1.5", "data.eval_fraction: 1.5 is a fraction"),
    ],
)
def test_bad_overrides_are_refused(override, needle):
    with pytest.raises(ValueError, match=None) as e:
        C.load_recipe("demo", [override])
    assert needle in str(e.value)


def test_string_fields_keep_what_was_typed(tmp_path, monkeypatch):
    """A string field takes the command line's text as written (YAML would make `no` False and `0x10` 16);
    in a recipe file an unquoted yes/no for a string is refused with the fix; a dir named like a recipe
    does not shadow it."""
    cfg = C.load_recipe("demo", ["run.out=no", "export.checkpoint=0x10", "train.init_from=1e3"])
    assert cfg.run.out == "no" and cfg.export.checkpoint == "0x10" and cfg.train.init_from == "1e3"
    p = tmp_path / "r.yaml"
    p.write_text("run:\n  out: no\n")
    with pytest.raises(ValueError, match=r"r.yaml:run.out: expected a string, got the boolean False; quote it"):
        C.load_recipe(str(p))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").mkdir()
    assert C.load_recipe("demo").train.ttt_steps == 3


def test_bad_recipe_file(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("train:\n  lr: 1e-4\n  bogus: 2\n")
    with pytest.raises(ValueError, match="r.yaml:train: unknown key 'bogus'"):
        C.load_recipe(str(p))
    p.write_text("trian:\n  lr: 1\n")
    with pytest.raises(ValueError, match="unknown section 'trian'"):
        C.load_recipe(str(p))
    with pytest.raises(ValueError, match="unknown recipe"):
        C.load_recipe("no-such-recipe")


def test_cli_config_refuses_unknown_key(capsys):
    assert main(["config", "--recipe", "demo", "train.no_such_key=1"]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'no_such_key'" in err and "max_steps" in err


def test_cli_config_prints_resolved(capsys):
    assert main(["config", "--recipe", "demo", "--section", "train", "train.max_steps=5"]) == 0
    out = capsys.readouterr().out
    assert "max_steps: 5" in out


def test_stage_flags_map_to_section(capsys):
    from eyas.cli import build_parser, resolve

    args = build_parser().parse_args(["synth", "--recipe", "demo", "seed=3", "--max-tokens", "7", "--endpoint", "u1", "u2"])
    cfg, actions = resolve(args, "synth")
    assert cfg.synth.max_tokens == 7 and cfg.synth.endpoint == ["u1", "u2"] and cfg.synth.seed == 3
    assert actions == []


def test_python_m_eyas_help():
    out = subprocess.run([sys.executable, "-m", "eyas", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for stage in ["models", "data", "synth", "extract", "train", "eval", "export", "quantize", "bench", "run", "config"]:
        assert stage in out.stdout


def test_one_definition_per_fact(tmp_path):
    """k and the eval prompts live in the eval section; their old places still set them there.
    A stage section without a target takes run.target; a choice outside a Literal is refused at load."""
    from eyas.cli import build_parser, resolve

    recipe = tmp_path / "r.yaml"
    recipe.write_text("run: {target: /t}\nexport: {k: 4}\ntrain: {eval_prompts: /p.jsonl}\n")
    cfg = C.load_recipe(str(recipe))
    assert cfg.eval.k == 4 and cfg.eval.prompts == "/p.jsonl" and not hasattr(cfg.export, "k")
    assert [cfg.synth.target, cfg.train.target, cfg.eval.target, cfg.export.target] == ["/t", "/t", "/t", ""]
    assert C.load_recipe(str(recipe), ["bench.k=5"]).eval.k == 5
    args = build_parser().parse_args(["export", "--recipe", str(recipe), "--k", "2", "run.target=/u"])
    cfg, _ = resolve(args, "export")
    assert cfg.eval.k == 2 and cfg.train.target == "/u"  # run.target set late still reaches the sections
    with pytest.raises(ValueError, match=r"extract.backend: 'foo' is not one of hf \| vllm"):
        C.load_recipe(str(recipe), ["extract.backend=foo"])
    bad = C.ExportConfig(dtype="fp4")  # built in code: the stage checks it with the same rule
    with pytest.raises(ValueError, match=r"export.dtype: 'fp4' is not one of bf16 \| fp8 \| fp8-emulated"):
        C.check_choices(bad, "export")


def test_overrides_may_follow_the_flags(capsys):
    from eyas.cli import main

    assert main(["config", "--recipe", "demo", "--section", "train", "train.max_steps=5"]) == 0
    # an action or override, then flags, then more overrides (`eyas bench simulated --recipe demo train.features=F`)
    assert main(["config", "eval.k=4", "--section", "eval", "--recipe", "demo", "eval.limit=2"]) == 0
    assert "k: 4" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["config", "--recipe", "demo", "--no-such-flag"])


def test_the_gpu_node_recipe_loads_and_sets_only_fields(capsys):
    """recipes/gpu-node.yaml resolves (`eyas config`), every key it sets is a field, and the settings it
    cites from public recipes are what it says."""
    import dataclasses

    import yaml

    from eyas import config as C
    from eyas.cli import main

    assert main(["config", "--recipe", "gpu-node"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    raw = yaml.safe_load((Path(__file__).resolve().parents[1] / "recipes" / "gpu-node.yaml").read_text())
    for section, values in raw.items():
        fields = {f.name for f in dataclasses.fields(C.SECTIONS[section])}
        assert set(values) <= fields, (section, set(values) - fields)
        assert all(resolved[section][k] == v for k, v in values.items()), section
    t = resolved["train"]
    assert (t["ttt_steps"], t["lr"], t["draft_vocab_size"], t["source"], resolved["run"]["nproc"]) == (7, 1e-4, 32000, "online", 8)
