"""Child processes die with eyas, however eyas ends (kill -9 included).

vLLM engines (in-process engine cores, `eyas.vllm_runner` processes, `vllm serve`) and
torchrun ranks are eyas's descendants; some run in their own session so that a signal
aimed at eyas's process group does not reach them half way. When eyas is killed they
are orphaned and keep their memory and cores. So each eyas command starts one watchdog
(`start_watchdog`, in its own session): it notes eyas's descendants every `poll_s`
seconds and, once eyas is gone, kills the ones still running (psutil checks each one's
start time, so a reused pid is never hit). It costs a sleeping process.

Temp dirs that engines share with eyas (a runner's spec and result, the hidden states the
vLLM backend hands over) are named with `scratch_prefix`: after the eyas process, removed on a
normal exit by their owner and, after a kill, by the watchdog once the processes are down.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_started: set[int] = set()  # pids that have a watchdog (one per process)


def start_watchdog(poll_s: float = 1.0) -> subprocess.Popen | None:
    """Watch this process's descendants from a separate process (once per process)."""
    if os.getpid() in _started or os.environ.get("EYAS_NO_WATCHDOG") == "1":
        return None
    _started.add(os.getpid())
    return subprocess.Popen([sys.executable, "-m", "eyas.children", str(os.getpid()), str(poll_s)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)


def scratch_prefix(what: str) -> str:
    """`eyas<PID>-<what>-`: a temp dir made with this prefix (`tempfile.mkdtemp` / `TemporaryDirectory`,
    in the system's temp dir or /dev/shm) is removed by this process's watchdog if the process is
    killed; its owner removes it otherwise."""
    return f"eyas{os.getpid()}-{what}-"


def _scratch_bases() -> set[str]:
    return {tempfile.gettempdir()} | ({"/dev/shm"} if os.path.isdir("/dev/shm") else set())


def remove_scratch(pid: int) -> list[str]:
    """Remove the scratch dirs of the (gone) process `pid`; returns them."""
    gone = [d for b in _scratch_bases() for d in Path(b).glob(f"eyas{pid}-*") if d.is_dir()]
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
    return [str(d) for d in gone]


def watch(pid: int, poll_s: float = 1.0) -> int:
    """Until `pid` ends, remember its descendants; then kill those still running. Returns how many."""
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return 0
    known: dict[int, psutil.Process] = {}
    while True:
        try:
            if root.status() == psutil.STATUS_ZOMBIE:
                break
            for c in root.children(recursive=True):
                if c.pid != os.getpid():  # the watchdog is one of them
                    known.setdefault(c.pid, c)
        except psutil.NoSuchProcess:
            break
        known = {p: c for p, c in known.items() if c.is_running()}
        time.sleep(poll_s)
    left = [c for c in known.values() if c.is_running()]
    for c in left:
        try:
            c.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=5)  # nothing writes into the scratch dirs once they are down
    remove_scratch(pid)
    return len(left)


if __name__ == "__main__":
    watch(int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 1.0)
