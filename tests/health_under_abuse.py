"""/health latency while requests at the limits are handled (issue 11 item 2), outside the
default test run:

    .venv/bin/python -m tests.health_under_abuse

Starts `specserve serve` on the default model and, for each abusive request (n = 128; 256
prompts of 2000 characters; a 7 MB prompt, tokenized off the event loop and then refused for
its length), polls /health every 50 ms while it runs and prints the median and worst latency.
"""

from __future__ import annotations

import statistics
import threading
import time

import httpx

from tests.server_process import ServerProcess

ABUSES = [
    ("chat n=128, max_tokens 64", "/v1/chat/completions",
     {"n": 128, "max_tokens": 64, "messages": [{"role": "user", "content": "Tell me a story."}]}),
    ("256 prompts of 2000 characters, max_tokens 4", "/v1/completions",
     {"max_tokens": 4, "prompt": ["lorem ipsum dolor sit amet " * 74] * 256}),
    ("one 7 MB prompt (tokenized, then refused for its length)", "/v1/completions",
     {"max_tokens": 4, "prompt": "word " * 1_400_000}),
]  # fmt: skip


def main() -> None:
    server = ServerProcess("--served-model-name", "m")
    try:
        server.wait_ready(600)
        for name, path, body in ABUSES:
            latencies: list[float] = []
            done = threading.Event()

            def poll(latencies=latencies, done=done):
                while not done.is_set():
                    start = time.perf_counter()
                    httpx.get(server.url + "/health", timeout=30)
                    latencies.append(time.perf_counter() - start)
                    time.sleep(0.05)

            poller = threading.Thread(target=poll)
            poller.start()
            start = time.perf_counter()
            r = httpx.post(server.url + path, json={"model": "m", **body}, timeout=600)
            took = time.perf_counter() - start
            done.set()
            poller.join()
            print(f"{name}: status {r.status_code} in {took:.1f} s; /health {len(latencies)} "
                  f"polls, median {statistics.median(latencies) * 1e3:.0f} ms, "
                  f"max {max(latencies) * 1e3:.0f} ms")  # fmt: skip
    finally:
        server.stop()


if __name__ == "__main__":
    main()
