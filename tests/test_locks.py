"""One writer per output (eyas.lock): a second writer is refused at once naming the holder, a shared cache
is taken in turn, a lock left by a kill -9 never blocks, and the processes a holder starts work inside
its locks. Two real `eyas models fetch` at once on an empty EYAS_HOME: both succeed, one conversion.
(Two `eyas extract` / `eyas train` at once: tests/test_faults.py; two `eyas run`: tests/test_pipeline.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from eyas.lock import Busy, held_env, lock_file, waiting, writing


def _holder(path: Path, how: str = "writing", sleep: float = 60, env: dict | None = None) -> subprocess.Popen:
    """A process that takes `path`'s lock (`how`), prints "held", and sleeps `sleep` s."""
    code = textwrap.dedent(f"""
        import sys, time
        from eyas.lock import {how}
        with {how}({str(path)!r}, "test"):
            print("held", flush=True)
            time.sleep({sleep})
        print("released", flush=True)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env)
    assert p.stdout.readline().strip() == "held", p.stderr.read()
    return p


def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    out = tmp_path / "feat"
    p = _holder(out)
    try:
        t0 = time.monotonic()
        with pytest.raises(Busy, match=rf"{out} is being written by pid {p.pid}: .*choose another output dir"):
            with writing(out, "eyas extract"):
                pass
        assert time.monotonic() - t0 < 2  # refused at once, not after a wait
    finally:
        p.kill()
        p.wait()


def test_a_lock_left_by_kill9_never_blocks(tmp_path):
    out = tmp_path / "run"
    p = _holder(out)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert lock_file(out).exists()  # the file stays; the OS lock went with the process
    with writing(out, "eyas train"):
        assert f"pid {os.getpid()}" in lock_file(out).read_text()


def test_the_same_process_takes_its_lock_again(tmp_path):
    with writing(tmp_path / "x", "a"), writing(tmp_path / "x", "b"):
        pass
    with writing(tmp_path / "x", "c"):  # and releases it after the outer block
        pass


def test_a_cache_is_waited_for_then_used(tmp_path, capfd):
    entry = tmp_path / "models" / "m"
    p = _holder(entry, how="waiting", sleep=2)
    t0 = time.monotonic()
    with waiting(entry, "fetching m"):
        waited = time.monotonic() - t0
    p.wait(timeout=30)
    assert waited > 0.5, "the second process did not wait for the first"
    assert f"waiting for pid {p.pid}" in capfd.readouterr().err


def test_children_write_inside_their_parents_lock(tmp_path):
    """`eyas run` holds the train dir and starts torchrun ranks: their `writing` passes (EYAS_HELD_LOCKS)."""
    out = tmp_path / "train"
    with writing(out, "eyas run"):
        env = held_env()
        assert str(out.resolve()) in env["EYAS_HELD_LOCKS"].split(os.pathsep)
        child = _holder(out, sleep=0, env=env)
        assert child.wait(timeout=30) == 0 and "released" in child.stdout.read()
        alone = subprocess.run([sys.executable, "-c", f"from eyas.lock import writing\nwith writing({str(out)!r}, 't'): pass"],
                               capture_output=True, text=True)
        assert alone.returncode != 0 and "is being written by" in alone.stderr


def test_the_checkpoint_key_is_never_read_half_made(tmp_path):
    """Processes that make the key at once all read the same 32 bytes (it is linked in whole)."""
    env = {**os.environ, "EYAS_HOME": str(tmp_path / "home")}
    code = "from eyas.checkpoints import _key; print(_key().hex())"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(6)]
    keys = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(keys) == 1 and len(keys.pop()) == 64
    assert sorted(os.listdir(tmp_path / "home")) == ["checkpoint.key"]  # no temp file left


@pytest.mark.slow
def test_two_model_fetches_at_once_convert_once(tmp_path):
    """Two `eyas models fetch` on an empty EYAS_HOME: both succeed, with the same dir; one converted."""
    env = {**os.environ, "EYAS_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "eyas", "models", "fetch", "smollm2-135m-instruct", "--no-check"]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    assert outs[0][0] == outs[1][0] == f"{tmp_path / 'home' / 'models' / 'smollm2-135m-instruct'}\n"
    err = "".join(e for _, e in outs)
    assert err.count("converting") == 1 and err.count("eyas: waiting for pid") == 1, err[-3000:]
    assert (tmp_path / "home/models/smollm2-135m-instruct/model.safetensors").exists()
