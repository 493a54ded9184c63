"""Replicas on Ray Serve against one ``specserve serve``, and a replica killed under load.

    specserve bench ray [--replicas 2] [--streams 40] [--max-tokens 64] [--kill server|actor]
                        [--stream-interval N]

In one run, the same ``streams`` concurrent streaming chats against (1) one ``specserve
serve``; (2) N of them without Ray, each on cores / N threads, the streams shared out evenly:
what splitting the machine costs; (3) ``--replicas N`` on a local Ray cluster (each replica
holding cores / N CPUs): what Ray's proxy, the ingress and routing cost on top. Output tokens/s
of each, the ratios, each cost in milliseconds a token of a stream, and each load's CPU by
process role (engines, servers, Ray's proxy, the ingress, ...) per output token. Then (4) while the
cluster streams ``streams`` long answers, one replica is killed
(its server, or its Ray actor): every stream must complete or end with an error event and
``[DONE]``; printed are the counts, how long until a new request is answered, and until the
cluster has all its replicas healthy again.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from server.ray_serve.proxied import REPLICA_HEADER
from tooling.bench.bench_serve import (
    LoadResult,
    chat_messages,
    free_port,
    report,
    run_load,
    start_server,
    stop_server,
)
from tooling.bench.process_cpu import ROLES, cpu_by_role, spent


def replica_processes(replica_id: str) -> tuple[int, int]:
    """``(actor_pid, server_pid)`` of a replica on this machine: the Ray worker running its
    actor, and its own ``specserve serve`` (the child of the tether the actor started)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if b"server.ray_serve.tethered" not in argv or replica_id.encode() not in argv:
                continue
            children = (proc / "task" / proc.name / "children").read_text().split()
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        return int(stat[1]), int(children[0])  # stat's 4th field (2nd after the name): ppid
    raise LookupError(f"no server process for replica {replica_id}")


def wait_for_replicas(url: str, count: int, timeout: float, besides: str | None = None) -> float:
    """Seconds until ``/health`` lists ``count`` healthy replicas (none of them ``besides``)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            states = httpx.get(f"{url}/health", timeout=10).json().get("replicas", {})
            if len(states) == count and all(states.values()) and besides not in states:
                return time.monotonic() - started
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not have {count} healthy replicas within {timeout:.0f} s")


@dataclass
class KillOutcome:
    completed: int
    ended_with_error: int
    broken: int  # neither: no [DONE], or cut without an error event (what must not happen)
    served_again_s: float  # from the kill to the first new request answered
    replaced_s: float  # from the kill to all replicas healthy again


async def _stream_outcome(client: httpx.AsyncClient, url: str, body: dict, started: dict,
                          first_token: asyncio.Event) -> str:  # fmt: skip
    """'completed', 'error' or 'broken'; notes which replica answered in ``started``."""
    events: list[str] = []
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return "error"  # refused before a stream began: a clean error too
            started[id(body)] = response.headers.get(REPLICA_HEADER, "")
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first_token.set()
    except httpx.HTTPError:
        return "broken"
    if not events or events[-1] != "[DONE]":
        return "broken"
    last = json.loads(events[-2]) if len(events) > 1 else {}
    if "error" in last:
        return "error"
    chunks = [json.loads(e) for e in events[:-1]]
    finished = [c.get("finish_reason") for chunk in chunks for c in chunk.get("choices", [])]
    return "completed" if any(finished) else "broken"


async def _kill_under_load(url: str, model: str, streams: int, max_tokens: int, kill: str,
                           replicas: int) -> KillOutcome:  # fmt: skip
    started: dict[int, str] = {}
    first_token = asyncio.Event()
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        bodies = [
            {"model": model, "messages": chat_messages(i), "max_tokens": max_tokens,
             "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
            for i in range(streams)
        ]
        tasks = [asyncio.create_task(_stream_outcome(client, url, b, started, first_token))
                 for b in bodies]  # fmt: skip
        await first_token.wait()
        while len(started) < streams and not all(t.done() for t in tasks):
            await asyncio.sleep(0.1)  # every stream begun (or over): the kill hits a full load
        counts: dict[str, int] = {}
        for replica in started.values():
            counts[replica] = counts.get(replica, 0) + 1
        victim = max(counts, key=counts.get)
        actor_pid, server_pid = replica_processes(victim)
        killed_at = time.monotonic()
        os.kill(server_pid if kill == "server" else actor_pid, signal.SIGKILL)
        served_again = None
        while served_again is None:
            probe = {"model": model, "messages": chat_messages(0), "max_tokens": 4}
            try:
                response = await client.post(f"{url}/v1/chat/completions", json=probe)
                if response.status_code == 200:
                    served_again = time.monotonic() - killed_at
            except httpx.HTTPError:
                pass
            if served_again is None:
                if time.monotonic() - killed_at > 120:
                    served_again = float("inf")
                await asyncio.sleep(0.5)
        outcomes = await asyncio.gather(*tasks)
        try:
            await asyncio.to_thread(wait_for_replicas, url, replicas, 300, victim)
            replaced = time.monotonic() - killed_at
        except TimeoutError:
            replaced = float("inf")
    return KillOutcome(outcomes.count("completed"), outcomes.count("error"),
                       outcomes.count("broken"), served_again, replaced)  # fmt: skip


def _serve_command(model: str | None, config: str | None, port: int, extra: list[str]) -> list:
    command = [sys.executable, "-m", "tooling.cli", "serve", "--port", str(port)]
    command += ["--model", model] if model else []
    command += ["--config", config] if config else []
    return command + extra


async def _split_load(name: str, urls: list[str], model: str, streams: int, max_tokens: int,
                      extra: dict) -> LoadResult:  # fmt: skip
    """``streams`` shared out among ``urls`` (no router: as even as can be), all at once."""
    shares = [streams // len(urls) + (i < streams % len(urls)) for i in range(len(urls))]
    loads = await asyncio.gather(*(
        run_load(name, url, model, share, share, max_tokens, extra)
        for url, share in zip(urls, shares, strict=True) if share
    ))  # fmt: skip
    return LoadResult(name, max(load.wall for load in loads),
                      [r for load in loads for r in load.results])  # fmt: skip


def _print_cpu(used: dict[str, tuple[dict[str, float], int]]) -> None:
    """Each load's CPU by process role, in milliseconds per output token."""
    print("\nCPU ms per output token, by process (from /proc):")
    print("| server | " + " | ".join(ROLES) + " | all |")
    print("|---|" + "---|" * (len(ROLES) + 1))
    for name, (seconds, tokens) in used.items():
        cells = [seconds[role] * 1e3 / max(tokens, 1) for role in ROLES]
        print(f"| {name} | " + " | ".join(f"{c:.2f}" for c in cells) + f" | {sum(cells):.2f} |")


def run_ray_bench(model: str | None, config: str | None, replicas: int, streams: int,
                  max_tokens: int, kill: str | None, stream_interval: int = 1,
                  proxy: str = "ray") -> dict:  # fmt: skip
    """Prints the comparison (and the kill's outcome); returns its numbers. Every server
    runs with ``--stream-interval stream_interval``; the cluster with ``--ray-proxy proxy``."""
    cores = len(os.sched_getaffinity(0))
    cpus = max(cores / replicas, 0.5)
    threads = str(max(1, int(cpus)))  # what each replica's engine runs (ClusterPlan)
    log_dir = tempfile.mkdtemp(prefix="specserve-bench-ray-")
    print(f"{streams} streams of {max_tokens} tokens; {cores} cores; stream interval "
          f"{stream_interval}; Ray's proxy: {proxy}; logs in {log_dir}")
    print("| server | output tokens | wall s | tok/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms |")
    print("|---|---|---|---|---|---|")
    # Usage in every stream: the servers' own token counts, no tokenizer needed.
    body = {"ignore_eos": True, "stream_options": {"include_usage": True}}
    rows: dict[str, float] = {}
    used: dict[str, tuple[dict[str, float], int]] = {}  # CPU s by role, output tokens
    result: dict = {}
    plans = (
        ("one specserve serve", [[]]),
        (f"{replicas} specserve serve, {threads} thread(s) each, no Ray",
         [["--threads", threads]] * replicas),
        (f"{replicas} replicas on Ray Serve",
         [["--replicas", str(replicas), "--replica-cpus", f"{cpus:g}", "--ray-proxy", proxy]]),
    )  # fmt: skip
    for index, (name, servers) in enumerate(plans):
        urls, procs = [], []
        try:
            for number, extra in enumerate(servers):
                port = free_port()
                urls.append(f"http://127.0.0.1:{port}")
                log = f"{log_dir}/{index}-{number}.log"
                interval = ["--stream-interval", str(stream_interval)]
                command = _serve_command(model, config, port, extra + interval)
                procs.append(start_server(command, urls[-1], log, timeout=900))
            on_ray = "--replicas" in servers[0]
            if on_ray:
                wait_for_replicas(urls[0], replicas, 900)
            served = httpx.get(f"{urls[0]}/v1/models", timeout=30).json()["data"][0]["id"]
            before = cpu_by_role()
            load = asyncio.run(_split_load(name, urls, served, streams, max_tokens, body))
            used[name] = (spent(before, cpu_by_role()), load.output_tokens(None))
            rows[name] = report(load, None)["tokens_per_s"]
            if on_ray and kill:
                result["kill"] = asyncio.run(_kill_under_load(
                    urls[0], served, streams, 4 * max_tokens, kill, replicas
                ))  # fmt: skip
        finally:
            for proc in procs:
                stop_server(proc)
    single, split, cluster = rows.values()

    def per_token_ms(slow: float, fast: float) -> float:  # added to each token of a stream
        return (1 / slow - 1 / fast) * 1e3 * streams

    result |= {"single": single, "split": split, "cluster": cluster}
    _print_cpu(used)
    print(f"\n{replicas} replicas on Ray / one server: {cluster / single:.2f}x output tokens/s; "
          f"of which splitting the cores: {split / single:.2f}x "
          f"({per_token_ms(split, single):+.1f} ms a token of a stream), Ray's proxy, ingress "
          f"and routing: {cluster / split:.2f}x "
          f"({per_token_ms(cluster, split):+.1f} ms)")  # fmt: skip
    if "kill" in result:
        k = result["kill"]
        print(f"killed one replica's {kill} under {streams} streams: {k.completed} completed, "
              f"{k.ended_with_error} ended with an error event and [DONE], {k.broken} broken; "
              f"a new request answered {k.served_again_s:.1f} s after the kill; "
              f"{replicas} replicas healthy again after {k.replaced_s:.1f} s")  # fmt: skip
    return result
