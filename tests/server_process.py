"""A real ``specserve serve`` process for server tests, on a free local port."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m server.cli serve ...`` in a subprocess; ``url`` once it listens."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, log_path: Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(self.port), *args]
        self.log_path = log_path
        self._log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd,
            env={**os.environ, **(env or {})},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 120) -> None:
        self._wait(lambda r: r is not None and r.status_code == 200, timeout, "become ready")

    def health(self) -> int | None:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code
        except httpx.HTTPError:
            return None

    def _wait(self, done, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                response = httpx.get(self.url + "/health", timeout=2)
            except httpx.HTTPError:
                response = None
            if done(response):
                return
            time.sleep(0.1)
        raise TimeoutError(f"server did not {what} within {timeout}s: {self.log_tail()}")

    def engine_pids(self) -> list[int]:
        """The server's engine-core child processes (not multiprocessing's helpers)."""
        pids = []
        # Any of the server's threads may have started it: look at every task's children.
        tasks = Path(f"/proc/{self.proc.pid}/task").glob("*/children")
        for pid in {p for t in tasks for p in t.read_text().split()}:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                pids.append(int(pid))
        return pids

    def log_tail(self, chars: int = 3000) -> str:
        if not self.log_path:
            return ""
        self._log.flush()
        return self.log_path.read_text()[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.log_path:
            self._log.close()


@contextlib.contextmanager
def serving_tiny(model_dir: Path, log_path: Path, *args: str):
    """``specserve serve`` on a tiny test model served as "tiny", with ``args``, ready; stopped
    on exit."""
    proc = ServerProcess("--model", str(model_dir), "--served-model-name", "tiny", *args,
                         log_path=log_path)  # fmt: skip
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()
