"""The API process's footprint: how soon it answers HTTP after start, when the engine is ready,
and its resident memory after a chat request (and whether torch got loaded into it).

    python -m tooling.bench.api_footprint [--repo DIR] [--runs 2]

``--repo`` runs another checkout's server the same way (``python -m server.cli serve`` in that
directory), so a before/after pair is measured in one run on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def measure(repo: Path) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    server = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "serve", "--port", str(port)],
        cwd=repo, env=dict(os.environ, PYTHONPATH=str(repo)),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        answered = ready = None
        while time.perf_counter() - started < 300 and ready is None:
            code = _status(f"{base}/health")
            now = time.perf_counter() - started
            answered = answered or (now if code is not None else None)
            ready = now if code == 200 else None
            time.sleep(0.05)
        body = {"model": "smollm2-135m-instruct", "max_tokens": 8,
                "messages": [{"role": "user", "content": "Hi"}]}  # fmt: skip
        request = urllib.request.Request(
            f"{base}/v1/chat/completions", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        urllib.request.urlopen(request, timeout=120).read()
        status = Path(f"/proc/{server.pid}/status").read_text()
        rss = next(line for line in status.splitlines() if line.startswith("VmRSS"))
        rss_kib = int(rss.split()[1])
        torch = "libtorch" in Path(f"/proc/{server.pid}/maps").read_text()
        return {"answers_s": answered, "ready_s": ready, "rss_mib": rss_kib / 1024, "torch": torch}
    finally:
        server.terminate()
        server.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", action="append", type=Path,
                        help="a checkout to measure (repeatable; default: this one)")  # fmt: skip
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    repos = args.repo or [Path(__file__).resolve().parents[2]]
    for run in range(args.runs):
        for repo in repos:
            m = measure(repo)
            print(f"run {run + 1} {repo}: HTTP after {m['answers_s']:.2f} s, engine ready after "
                  f"{m['ready_s']:.2f} s, API process RSS {m['rss_mib']:.0f} MiB after a chat "
                  f"request, torch loaded: {m['torch']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
