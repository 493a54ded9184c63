"""``tests/utils.py`` as vLLM's entrypoint tests import it, for a run against specserve:
``RemoteOpenAIServer`` starts ``specserve serve`` instead of ``vllm serve``.

The model each test module asks for (``MODEL_NAME``, a hub id this machine may not reach) is
served under that name from the model the runner was given (``SPECSERVE_VLLM_SUITE_MODEL``), so
the tests' requests name the model they expect. vLLM's own flags (LoRA modules, dtypes,
memory settings) have no counterpart here and are recorded in the log, not passed on.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai


def get_open_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteOpenAIServer:
    DUMMY_API_KEY = "token-abc123"  # vLLM's tests send it; a server without keys ignores it

    def __init__(self, model: str, vllm_serve_args: list[str], *, env_dict=None, seed=0,
                 auto_port=True, max_wait_seconds=None, override_hf_configs=None):  # fmt: skip
        self.host, self.port = "127.0.0.1", get_open_port()
        log_dir = Path(os.environ.get("SPECSERVE_VLLM_SUITE_LOGS", "."))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"server-{self.port}.log"
        cmd = [
            sys.executable, "-m", "server.cli", "serve",
            "--model", os.environ["SPECSERVE_VLLM_SUITE_MODEL"],
            "--served-model-name", model,
            "--port", str(self.port),
        ]  # fmt: skip
        self._log = open(self.log_path, "w")  # noqa: SIM115
        self._log.write(f"vLLM's flags, not passed on: {vllm_serve_args}\n")
        self._log.flush()
        self.proc = subprocess.Popen(
            cmd, env={**os.environ, **(env_dict or {})}, stdout=self._log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + (max_wait_seconds or 300)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"specserve serve exited: see {self.log_path}")
            try:
                if httpx.get(self.url_for("health"), timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self._shutdown()
        raise RuntimeError(f"specserve serve did not become ready: see {self.log_path}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._shutdown()

    def _shutdown(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        path = "/".join(part.strip("/") for part in parts if part)
        return f"{self.url_root}/{path}"

    def get_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY,
                             max_retries=0, **kwargs)  # fmt: skip

    def get_async_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY,
                                  max_retries=0, **kwargs)  # fmt: skip
