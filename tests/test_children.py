"""eyas.children: what an eyas command starts dies with it, kill -9 included."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

# a parent that starts the watchdog, then a child in its own session (as eyas starts vLLM runners and
# servers) which starts a grandchild (as a runner starts vLLM's engine core); it prints their pids
PARENT = """
import subprocess, sys, time
from eyas.children import start_watchdog
start_watchdog(poll_s=0.2)
import tempfile
from eyas.children import scratch_prefix
scratch = tempfile.mkdtemp(prefix=scratch_prefix("test"))
code = "import subprocess, sys, time; g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); print(g.pid, flush=True); time.sleep(600)"
c = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
print(c.pid, c.stdout.readline().strip(), scratch, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_descendants_die_with_a_killed_parent():
    """...and its scratch dir (a vLLM runner's spec and result) goes with them."""
    env = {k: v for k, v in os.environ.items() if k != "EYAS_NO_WATCHDOG"}
    mine = tempfile.mkdtemp(prefix="eyas-mine-")  # a user's dir beside the scratch dirs: never touched
    (Path(mine) / "notes.txt").write_text("keep")
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, env=env)
    child, grandchild, scratch = parent.stdout.readline().split()
    child, grandchild = int(child), int(grandchild)
    time.sleep(1.0)  # the watchdog has seen both
    assert _alive(child) and _alive(grandchild) and os.path.isdir(scratch)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (_alive(child) or _alive(grandchild) or os.path.isdir(scratch)):
        time.sleep(0.2)
    assert not _alive(child) and not _alive(grandchild)
    assert not os.path.exists(scratch), "the killed command's scratch dir is left behind"
    assert (Path(mine) / "notes.txt").read_text() == "keep"
    shutil.rmtree(mine)


def test_watch_kills_nothing_while_the_parent_lives_and_nothing_foreign():
    from eyas.children import watch

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        # a process that exits at once: its (no) descendants are killed, the unrelated sleeper lives
        short = subprocess.Popen([sys.executable, "-c", "pass"])
        assert watch(short.pid, poll_s=0.1) == 0
        assert _alive(sleeper.pid)
        short.wait()
    finally:
        sleeper.kill()
        sleeper.wait()
