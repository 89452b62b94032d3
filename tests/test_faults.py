"""Fault injection: each resumable stage is killed (SIGKILL, by eyas.faults) at seeded random points of
its own run, re-run with the same command until it finishes, and must end exactly as an uninterrupted
run: every conversation / sample / step once, outputs equal bit for bit, no debris left.

A reference run logs every failpoint it passes (EYAS_FAILPOINT_LOG); each seed draws kill points
from that log: the k-th pass through a name is the point. A re-run that resumes past a drawn point
finishes instead, which is as good an outcome."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_extract import write_convs

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
SEEDS = (0, 1, 2)
KILLS = 3  # kill points drawn per seed; each re-run gets the next one


def run(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env={**ENV, **env}, capture_output=True, text=True, timeout=600)


def reference(cmd: list[str], log: Path) -> list[str]:
    """Run `cmd` uninterrupted; the failpoints it passed, in order."""
    res = run(cmd, EYAS_FAILPOINT_LOG=str(log))
    assert res.returncode == 0, res.stderr[-3000:]
    points = log.read_text().split()
    assert points, "the reference run passed no failpoint"
    return points


def draw(points: list[str], seed: int) -> list[str]:
    """KILLS points `NAME:N` (the N-th pass through NAME), at seeded random places of a reference run."""
    rng = random.Random(seed)
    picks = sorted(rng.sample(range(len(points)), KILLS))
    return [f"{points[i]}:{points[: i + 1].count(points[i])}" for i in picks]


def killed_until_done(cmd: list[str], kills: list[str]) -> list[str]:
    """Run `cmd` with each kill point in turn, then without: the kill points that landed."""
    landed = []
    for spec in kills:
        res = run(cmd, EYAS_FAILPOINTS=spec)
        if res.returncode == 0:
            continue  # the re-run resumed past this point
        assert res.returncode == -9, f"{spec}: exit {res.returncode}, not a kill:\n{res.stderr[-3000:]}"
        landed.append(spec)
    res = run(cmd)
    assert res.returncode == 0, f"after kills at {landed}:\n{res.stderr[-3000:]}"
    return landed


def debris(d: Path) -> list[str]:
    """Temp files and half-made checkpoints a kill can leave (eyas.io, eyas.train.checkpoint names)."""
    return sorted(str(p.relative_to(d)) for p in d.rglob("*")
                  if ".tmp." in p.name or p.name.startswith((".tmp_", ".old_")))


# ---------------------------------------------------------------- extract

@pytest.fixture(scope="module")
def extract_ref(tmp_path_factory, tiny_llama):
    d = tmp_path_factory.mktemp("faults_extract")
    data = write_convs(d / "convs.jsonl", 24)

    def cmd(out: Path) -> list[str]:  # --batch-tokens 1: one conversation per forward, so no padding differs
        return [sys.executable, "-m", "eyas", "extract", "--target", str(tiny_llama), "--data", str(data),
                "--out", str(out), "--samples-per-shard", "3", "--layer-ids", "1", "2", "3", "--batch-tokens", "1",
                "--compute-dtype", "fp32"]

    points = reference(cmd(d / "ref"), d / "ref.log")
    return cmd, d / "ref", points


def _samples(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    from eyas.features import open_features

    ds = open_features(path)
    return {ds.ids[i]: ds[i] for i in range(len(ds))}


@pytest.mark.parametrize("seed", SEEDS)
def test_extract_killed_at_random_points(tmp_path, extract_ref, seed):
    from eyas.features import verify_features

    cmd, ref, points = extract_ref
    assert {"extract.shard", "write.before_rename"} <= set(points)
    out = tmp_path / "feat"
    landed = killed_until_done(cmd(out), draw(points, seed))
    assert landed, "no kill landed"
    assert verify_features(out)["samples"] == 24
    got, want = _samples(out), _samples(ref)
    assert sorted(got) == sorted(want)  # every conversation once
    for i, s in want.items():
        assert s.keys() == got[i].keys()
        for k, t in s.items():
            same = torch.equal(got[i][k], t) if isinstance(t, torch.Tensor) else got[i][k] == t
            assert same, f"{i}/{k} differs after kills at {landed}"
    assert debris(out) == []


# ---------------------------------------------------------------- train

@pytest.fixture(scope="module")
def train_ref(tmp_path_factory, tiny_llama):
    from eyas.config import ExtractConfig
    from eyas.extract import extract

    d = tmp_path_factory.mktemp("faults_train")
    write_convs(d / "convs.jsonl", 24)
    extract(ExtractConfig(target=str(tiny_llama), data=str(d / "convs.jsonl"), out=str(d / "feat"),
                          compute_dtype="fp32", samples_per_shard=8))

    def cmd(out: Path) -> list[str]:
        return [sys.executable, "-m", "eyas", "train", "--target", str(tiny_llama), "--features", str(d / "feat"),
                "--out", str(out), "--max-steps", "8", "--token-budget", "256", "--draft-vocab-size", "512",
                "--lr", "0.002", "--warmup-steps", "2", "--log-every", "1", "--save-every", "2", "--ttt-steps", "3",
                "--threads", "1", "--precision", "fp32", "--no-progress", "--resume"]

    warm = run(cmd(d / "warm"))  # fills the draft-vocab cache: every run below hits it, the reference too
    assert warm.returncode == 0, warm.stderr[-3000:]
    points = reference(cmd(d / "ref"), d / "ref.log")
    return cmd, d / "ref", points


def _steps(run_dir: Path) -> list[tuple[int, float]]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [(r["step"], r["loss"]) for r in recs if "loss" in r]


@pytest.mark.parametrize("seed", SEEDS)
def test_train_killed_at_random_points(tmp_path, train_ref, seed):
    from safetensors.torch import load_file

    cmd, ref, points = train_ref
    assert {"train.step", "checkpoint.dcp", "checkpoint.renamed", "append.torn"} <= set(points)
    out = tmp_path / "run"
    mine = out / "checkpoints" / "step_4.notes"  # a user's file beside the checkpoints eyas swaps and removes
    mine.parent.mkdir(parents=True)
    mine.write_text("mine")
    landed = killed_until_done(cmd(out), draw(points, seed))
    assert landed, "no kill landed"
    assert mine.read_text() == "mine"
    mine.unlink()
    assert _steps(out) == _steps(ref)  # every step logged once, with the uninterrupted run's loss
    ck = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ck == sorted(p.name for p in (ref / "checkpoints").iterdir())
    for step in ("step_2", "step_4", "step_6", "step_8"):
        got = load_file(out / "checkpoints" / step / "draft.safetensors")
        want = load_file(ref / "checkpoints" / step / "draft.safetensors")
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), f"{step} differs after kills at {landed}"
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_8"
    assert json.loads((out / "manifest.json").read_text())["complete"]
    assert debris(out) == []


def test_train_killed_writing_latest(tmp_path, train_ref):
    """Killed inside the atomic write of `latest` right after step_8 is renamed in (its temp file
    written, not renamed): the re-run removes the killed write's temp file and `latest` names step_8
    (the random suite found the temp file left behind)."""
    cmd, ref, points = train_ref
    last = max(i for i, p in enumerate(points) if p == "checkpoint.renamed")
    n = points[: last + 1].count("write.before_rename") + 1  # the next atomic write: `latest`
    out = tmp_path / "run"
    kill = f"write.before_rename:{n}"
    assert killed_until_done(cmd(out), [kill]) == [kill]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_8"
    assert _steps(out) == _steps(ref) and debris(out) == []


def test_train_killed_writing_the_last_file(tmp_path, train_ref):
    """Killed inside the run's last atomic write (the manifest that marks it complete, after step_8):
    the re-run removes the temp file, marks the run complete and trains nothing again (it used to
    see step_8 = max_steps and stop with the manifest left incomplete)."""
    cmd, ref, points = train_ref
    out = tmp_path / "run"
    res = run(cmd(out), EYAS_FAILPOINTS=f"write.before_rename:{points.count('write.before_rename')}")
    assert res.returncode == -9, res.stderr[-3000:]
    assert [p.split(".tmp.")[0] for p in debris(out)] == [".manifest.json"]
    assert not json.loads((out / "manifest.json").read_text())["complete"]
    mine = out / ".notes.tmp.keep"  # a user's file with a temp-like name: not eyas's `.NAME.tmp.PID`
    mine.write_text("mine")
    res = run(cmd(out))
    assert res.returncode == 0, res.stderr[-3000:]
    assert mine.read_text() == "mine"
    mine.unlink()
    man = json.loads((out / "manifest.json").read_text())
    assert man["complete"] and (out / "checkpoints" / "latest").read_text().strip() == "step_8"
    assert _steps(out) == _steps(ref) and debris(out) == []


def test_train_resaves_a_checkpoint_whole(tmp_path, train_ref):
    """Killed with step_4 renamed in but `latest` still on step_2: the re-run resumes from step_2 and
    saves step_4 again, swapping the old dir out before removing it; a user's file beside it stays."""
    from safetensors.torch import load_file

    cmd, ref, _ = train_ref
    out = tmp_path / "run"
    mine = out / "checkpoints" / "step_4.notes"
    mine.parent.mkdir(parents=True)
    mine.write_text("mine")
    assert killed_until_done(cmd(out), ["checkpoint.renamed:2"]) == ["checkpoint.renamed:2"]
    assert mine.read_text() == "mine"
    got = load_file(out / "checkpoints" / "step_4" / "draft.safetensors")
    want = load_file(ref / "checkpoints" / "step_4" / "draft.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert _steps(out) == _steps(ref) and debris(out) == []


def same_features(out: Path, ref: Path) -> None:
    """Every conversation once, every tensor bit-equal to the reference's."""
    got, want = _samples(out), _samples(ref)
    assert sorted(got) == sorted(want)
    for i, s in want.items():
        for k, t in s.items():
            assert torch.equal(got[i][k], t) if isinstance(t, torch.Tensor) else got[i][k] == t, f"{i}/{k} differs"


def same_training(out: Path, ref: Path, steps=("step_2", "step_4", "step_6", "step_8")) -> None:
    """Every step logged once with the reference's loss; the checkpoints' weights bit-equal."""
    from safetensors.torch import load_file

    assert _steps(out) == _steps(ref)
    for step in steps:
        got = load_file(out / "checkpoints" / step / "draft.safetensors")
        want = load_file(ref / "checkpoints" / step / "draft.safetensors")
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), f"{step} differs"


# ---------------------------------------------------------------- a full disk, a read-only dir

WRITES = ("write.before_rename", "append.torn", "extract.shard", "checkpoint.dcp", "checkpoint.renamed")
CAUSE = {"enospc": "No space left on device", "eacces": "Permission denied"}


def write_points(points: list[str], seed: int) -> list[str]:
    """One seeded pass through each kind of write the reference run made, each early enough in its
    share of the run that the re-runs (each resuming past the last failure) still reach it."""
    rng = random.Random(seed)
    kinds = [name for name in WRITES if name in points]
    return [f"{name}:{rng.randint(1, max(1, points.count(name) // (len(kinds) + 1)))}" for name in kinds]


def one_error_line(res: subprocess.CompletedProcess, stage: str, mode: str) -> str:
    """The command stopped with exit 2 and one line naming a path and the cause, no traceback."""
    assert res.returncode == 2, f"exit {res.returncode}:\n{res.stderr[-3000:]}"
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    line = [x for x in res.stderr.splitlines() if x.strip()][-1]
    assert line.startswith(f"eyas {stage}: error: /") and f": {CAUSE[mode]} (" in line, line
    return line


def failed_until_done(cmd: list[str], stage: str, points: list[str], mode: str, check) -> list[str]:
    """Run `cmd` failing (ENOSPC / EACCES) at each point in turn, `check` the dir after each, then
    run it plainly (the cause removed): the error lines."""
    lines = []
    for spec in points:
        res = run(cmd, EYAS_FAILPOINTS=f"{spec}:{mode}")
        if res.returncode == 0:
            continue  # resumed past this point
        lines.append(one_error_line(res, stage, mode))
        check()
    res = run(cmd)
    assert res.returncode == 0, f"after {lines}:\n{res.stderr[-3000:]}"
    return lines


@pytest.mark.parametrize("mode", ["enospc", "eacces"])
def test_extract_through_failed_writes(tmp_path, extract_ref, mode):
    from eyas.features import verify_features

    cmd, ref, points = extract_ref
    out = tmp_path / "feat"

    def check():
        assert debris(out) == []
        if (out / "manifest.json").exists():
            try:
                verify_features(out)  # every shard it lists is whole (checksums, shapes, counts) ...
            except ValueError as e:  # ... in a dir not complete yet
                assert str(e).split("\n  ")[1:] == ["manifest says the extraction is not complete"], str(e)

    picks = write_points(points, 0)
    lines = failed_until_done(cmd(out), "extract", picks, mode, check)
    assert len(lines) == len(picks) == 2, (picks, lines)
    same_features(out, ref)
    assert debris(out) == []


@pytest.mark.parametrize("mode", ["enospc", "eacces"])
def test_train_through_failed_writes(tmp_path, train_ref, mode):
    from eyas.checkpoints import is_complete, latest_checkpoint

    cmd, ref, points = train_ref
    out = tmp_path / "run"

    def check():
        assert debris(out) == []
        steps = list((out / "checkpoints").glob("step_*")) if (out / "checkpoints").exists() else []
        assert all(is_complete(s) for s in steps), steps  # nothing half-made under a checkpoint's name
        if steps:
            assert latest_checkpoint(out) is not None
        if (out / "metrics.jsonl").exists():
            assert (out / "metrics.jsonl").read_bytes()[-1:] in (b"", b"\n")  # no torn line

    picks = write_points(points, 1)
    assert {p.split(":")[0] for p in picks} >= {"append.torn", "checkpoint.dcp", "checkpoint.renamed"}
    lines = failed_until_done(cmd(out), "train", picks, mode, check)
    assert len(lines) == len(picks), (picks, lines)
    same_training(out, ref)
    assert json.loads((out / "manifest.json").read_text())["complete"] and debris(out) == []


# ---------------------------------------------------------------- one writer per output

def together(cmd: list[str], gate: Path, point: str) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """Start `cmd` twice at once; each waits at `point` (its first write inside the lock) until `gate` opens,
    which it does once one of them has ended. (refused, finished)."""
    env = {**ENV, "EYAS_FAILPOINTS": f"{point}:gate", "EYAS_FAILPOINT_GATE": str(gate)}
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    t0 = time.monotonic()
    while all(p.poll() is None for p in procs):
        assert time.monotonic() - t0 < 300, "neither ended while the gate was shut"
        time.sleep(0.1)
    gate.write_text("open")
    res = [subprocess.CompletedProcess(p.args, p.wait(timeout=600), *p.communicate()) for p in procs]
    res.sort(key=lambda r: r.returncode != 2)
    refused, done = res
    assert refused.returncode == 2 and done.returncode == 0, [(r.returncode, r.stderr[-2000:]) for r in res]
    assert "Traceback" not in refused.stderr
    return refused, done


def test_two_extracts_at_once_one_is_refused(tmp_path, extract_ref):
    cmd, ref, _ = extract_ref
    out = tmp_path / "feat"
    refused, done = together(cmd(out), tmp_path / "gate", "write.before_rename:1")
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith(f"eyas extract: error: {out} is being written by pid ") and "eyas extract" in line, line
    same_features(out, ref)


def test_two_trainings_at_once_one_is_refused(tmp_path, train_ref):
    cmd, ref, _ = train_ref
    out = tmp_path / "run"
    refused, done = together(cmd(out), tmp_path / "gate", "write.before_rename:1")
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith(f"eyas train: error: {out} is being written by pid ") and "eyas train" in line, line
    same_training(out, ref)


# ---------------------------------------------------------------- a real full disk

@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of a given size (mount needs root / CAP_SYS_ADMIN: skipped where not permitted), and a
    function that grows it: `disk(size)` mounts or remounts, returns the mount point."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    mounted = []

    def disk(size: str) -> Path:
        opts = f"size={size}" + (",remount" if mounted else "")
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mnt)], capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip()}): the failpoint tests above still run")
        mounted.append(size)
        return mnt

    yield disk
    if mounted:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_extract_on_a_full_disk_then_freed(small_disk, extract_ref):
    cmd, ref, _ = extract_ref
    out = small_disk("1m") / "feat"  # the features take 1.9 MB
    res = run(cmd(out))
    line = one_error_line(res, "extract", "enospc")
    assert str(out) in line and debris(out) == []
    small_disk("64m")  # the cause removed
    res = run(cmd(out))
    assert res.returncode == 0, res.stderr[-3000:]
    same_features(out, ref)


def test_train_on_a_full_disk_then_freed(small_disk, train_ref):
    from eyas.checkpoints import is_complete

    cmd, ref, _ = train_ref
    out = small_disk("45m") / "run"  # 4 checkpoints of ~26 MB: full while writing the second
    res = run(cmd(out))
    line = one_error_line(res, "train", "enospc")
    assert str(out) in line and debris(out) == [], line
    steps = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert steps == ["step_2"] and all(is_complete(out / "checkpoints" / s) for s in steps)
    small_disk("256m")
    res = run(cmd(out))
    assert res.returncode == 0, res.stderr[-3000:]
    same_training(out, ref)
