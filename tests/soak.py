"""Soak test of a real server (issue 11), outside the default test run:

    .venv/bin/python -m tests.soak --requests 1000 --concurrency 32 [--model PATH]

Starts ``specserve serve`` (the default model unless --model), takes a baseline of the server's
and the engine's file descriptors, threads and resident memory after a warm-up, then sends
--requests streaming requests, --concurrency at a time: a share of them (--disconnect, 30%)
hang up mid-stream, and one in ten goes over a WebSocket and is cancelled mid-stream. Once idle
it checks that no request is running, the KV cache is back to empty, no file descriptor or
thread leaked, and memory is within 10% of the baseline; it prints a report and exits 1 if a
check fails. Leaked asyncio tasks would show as memory growth and running requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import websockets

from tests.server_process import ServerProcess

PROMPTS = [
    "Write a haiku about rivers.",
    "Explain what a hash table is.",
    "List three uses of copper.",
    "Tell a short story about a lighthouse keeper.",
]


def process_counts(pid: int) -> dict[str, int]:
    """Open file descriptors, threads and resident memory (KiB) of a process."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in status if ":" in line)
    return {
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(fields["Threads"]),
        "rss_kib": int(fields["VmRSS"].split()[0]),
    }


def metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if not line.startswith("#") and name in line.split("{")[0].split(" ")[0]:
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


async def sse_request(client, server, model, rng, disconnect: bool) -> str:
    body = {
        "model": model,
        "stream": True,
        "max_tokens": rng.randint(8, 48),
        "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
    }
    async with client.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return f"status {r.status_code}"
        lines = 0
        async for line in r.aiter_lines():
            lines += line.startswith("data:")
            if disconnect and lines >= 3:
                return "disconnected"  # leaving the block closes the connection mid-stream
            if line == "data: [DONE]":
                return "done"
    return "ended without [DONE]"


async def ws_request(server, model, rng) -> str:
    url = server.url.replace("http", "ws") + "/v1/ws"
    async with websockets.connect(url) as ws:
        request = {"request_id": "soak", "model": model, "max_tokens": 64,
                   "messages": [{"role": "user", "content": rng.choice(PROMPTS)}]}  # fmt: skip
        await ws.send(json.dumps(request))
        await ws.recv()
        await ws.send(json.dumps({"type": "cancel", "request_id": "soak"}))
        while True:
            message = json.loads(await ws.recv())
            if message.get("type") in ("done", "error"):
                return "ws cancelled" if message.get("cancelled") else f"ws {message['type']}"


async def load(server, model, requests: int, concurrency: int, disconnect: float) -> dict:
    rng = random.Random(0)
    outcomes: dict[str, int] = {}
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def one(i: int) -> None:
            async with gate:
                try:
                    if i % 10 == 9:
                        outcome = await ws_request(server, model, rng)
                    else:
                        outcome = await sse_request(
                            client, server, model, rng, rng.random() < disconnect
                        )
                except Exception as e:  # noqa: BLE001 - counted and reported
                    outcome = f"client error {type(e).__name__}"
                outcomes[outcome] = outcomes.get(outcome, 0) + 1

        await asyncio.gather(*(one(i) for i in range(requests)))
    return outcomes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--disconnect", type=float, default=0.3, help="share hanging up mid-stream")
    p.add_argument("--model", help="model to serve (default: the embedded default)")
    args = p.parse_args(argv)
    log = Path(tempfile.mkdtemp()) / "server.log"
    extra = ["--model", args.model] if args.model else []
    server = ServerProcess(*extra, "--served-model-name", "soak", log_path=log)
    try:
        server.wait_ready(600)
        (engine,) = server.engine_pids()
        asyncio.run(load(server, "soak", 16, 8, 0.0))  # warm-up: caches, pools, threads
        time.sleep(2)
        before = {"server": process_counts(server.proc.pid), "engine": process_counts(engine)}
        started = time.monotonic()
        outcomes = asyncio.run(
            load(server, "soak", args.requests, args.concurrency, args.disconnect)
        )
        elapsed = time.monotonic() - started
        time.sleep(3)  # aborts land, the engine goes idle
        after = {"server": process_counts(server.proc.pid), "engine": process_counts(engine)}
        running = metric(server, "num_requests_running")
        kv = metric(server, "kv_cache_usage_perc")
    finally:
        server.stop()
    print(f"{args.requests} requests, concurrency {args.concurrency}, {elapsed:.0f} s")
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    failures = []
    for name in ("server", "engine"):
        b, a = before[name], after[name]
        print(f"{name}: fds {b['fds']} -> {a['fds']}, threads {b['threads']} -> {a['threads']}, "
              f"RSS {b['rss_kib'] / 1024:.0f} -> {a['rss_kib'] / 1024:.0f} MiB")  # fmt: skip
        if a["fds"] > b["fds"] or a["threads"] > b["threads"]:
            failures.append(f"{name} leaked file descriptors or threads")
        if a["rss_kib"] > 1.10 * b["rss_kib"]:
            failures.append(f"{name} memory grew by more than 10%")
    print(f"after: running requests {running:g}, KV cache usage {kv:g}")
    if running != 0 or kv != 0:
        failures.append("requests or KV blocks left behind")
    bad = {k: v for k, v in outcomes.items() if k.startswith(("status", "client", "ended"))}
    if bad:
        failures.append(f"unexpected outcomes {bad}")
    print("PASS" if not failures else "FAIL: " + "; ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
