"""specserve replicas on Ray Serve (server/ray_serve/): the prefix keys, the plan's refusals,
the metrics merge, the router's rule, and a real local Ray cluster of two tiny-model replicas:
streaming through Ray's proxy, conversations kept on the replica holding their prefix, a
replica killed mid-stream, /health and /metrics. Skipped where Ray Serve is not installed."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is an optional extra: specserve[ray]")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from server.cli_serve import replica_arguments  # noqa: E402
from server.ray_serve.app import ClusterPlan, replica_start_failure  # noqa: E402
from server.ray_serve.cluster_env import (  # noqa: E402
    CONTROL_LOOP_ENV,
    CONTROL_LOOP_SECONDS,
    HAPROXY_ENV,
    PROXIES,
    prepare_cluster_env,
)
from server.ray_serve.ingress import REPLICA_HEADER, merge_metrics  # noqa: E402
from server.ray_serve.prefix_keys import (  # noqa: E402
    BLOCK_CHARS,
    prefix_hashes,
    prompt_text,
    request_prefix_hashes,
)
from server.ray_serve.replica import REPLICA_START_FAILED, parse_gauges  # noqa: E402
from server.ray_serve.tethered import REASON_FILE_ENV  # noqa: E402
from tooling.bench.bench_ray import replica_processes  # noqa: E402

# ------------------------------------------------------------------------------- no cluster


def test_a_conversation_shares_its_history_s_prefix_hashes():
    history = [{"role": "user", "content": "x" * 600}, {"role": "assistant", "content": "y" * 300}]
    first = prefix_hashes(prompt_text({"messages": history[:1]}))
    later = prefix_hashes(prompt_text({"messages": [*history, {"role": "user", "content": "z"}]}))
    assert len(first) == 2 and later[:2] == first  # whole blocks only: 600 chars -> 2
    other = prefix_hashes(prompt_text({"messages": [{"role": "user", "content": "w" * 600}]}))
    assert not set(other) & set(later)
    assert prefix_hashes("a" * (BLOCK_CHARS - 1)) == []
    assert request_prefix_hashes(b"not json") == [] and request_prefix_hashes(b"[1]") == []
    completion = json.dumps({"prompt": ["p" * 300, "q"]}).encode()
    assert request_prefix_hashes(completion) == prefix_hashes("p" * 300)


def test_replicas_get_the_serve_flags_but_not_the_cluster_s():
    argv = ["--replicas", "2", "--decoder", "ngram", "--port=9000", "--host", "0.0.0.0",
            "--ray-address", "auto", "--max-tokens-limit", "5", "--ray-proxy", "haproxy",
            "--stream-interval", "4"]  # fmt: skip
    assert replica_arguments(argv) == ["--decoder", "ngram", "--max-tokens-limit", "5",
                                       "--stream-interval", "4"]  # fmt: skip


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (ClusterPlan(replicas=0), "--replicas must be at least 1"),
        (ClusterPlan(min_replicas=2), "go together"),
        (ClusterPlan(min_replicas=3, max_replicas=2), "--min-replicas <= --max-replicas"),
        (ClusterPlan(cpus_per_replica=0), "needs some CPU"),
    ],
)
def test_plans_that_cannot_run_are_refused(plan, message):
    with pytest.raises(ValueError, match=message):
        plan.check()


def test_a_started_cluster_gets_the_proxy_and_a_slower_controller_loop(monkeypatch):
    monkeypatch.setenv(HAPROXY_ENV, "1")  # Ray is imported here: it must already agree
    monkeypatch.delenv(CONTROL_LOOP_ENV, raising=False)
    prepare_cluster_env("haproxy", None)
    assert os.environ[HAPROXY_ENV] == "1"
    assert float(os.environ[CONTROL_LOOP_ENV]) == CONTROL_LOOP_SECONDS
    monkeypatch.setenv(CONTROL_LOOP_ENV, "0.2")  # the user's own setting wins
    prepare_cluster_env("haproxy", None)
    assert os.environ[CONTROL_LOOP_ENV] == "0.2"


def test_cluster_settings_that_cannot_apply_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="cluster this command starts"):
        prepare_cluster_env("haproxy", "ray://head:10001")  # a joined cluster's own choice
    with pytest.raises(ValueError, match="--ray-proxy"):
        prepare_cluster_env("nginx", None)
    monkeypatch.setenv(HAPROXY_ENV, "0")
    with pytest.raises(RuntimeError, match="before Ray is imported"):
        prepare_cluster_env("haproxy", None)  # this process imported Ray already
    monkeypatch.delenv(CONTROL_LOOP_ENV, raising=False)
    prepare_cluster_env("ray", "ray://head:10001")  # joined: nothing of ours to set
    assert CONTROL_LOOP_ENV not in os.environ


def test_plans_the_cluster_cannot_hold_are_refused():
    with pytest.raises(ValueError, match="need 8 CPU; the cluster has 2"):
        ClusterPlan(replicas=4, cpus_per_replica=2).check_fits({"CPU": 2.0})
    with pytest.raises(ValueError, match="need 2 GPU; the cluster has 0"):
        ClusterPlan(replicas=2, gpus_per_replica=1).check_fits({"CPU": 16.0})
    ClusterPlan(replicas=2, cpus_per_replica=1).check_fits({"CPU": 2.0})


def test_a_replica_s_engine_runs_the_threads_of_the_cpus_it_holds():
    assert ClusterPlan(cpus_per_replica=2.5).replica_serve_args() == ["--threads", "2"]
    assert ClusterPlan(cpus_per_replica=0.5).replica_serve_args() == ["--threads", "1"]
    given = ["--threads=3", "--decoder", "ngram"]
    assert ClusterPlan(serve_args=given, cpus_per_replica=1).replica_serve_args() == given
    assert ClusterPlan(cpus_per_replica=4, gpus_per_replica=1).replica_serve_args() == []


def test_replica_metrics_merge_into_one_labelled_text():
    text = (
        "# HELP specserve:num_requests_running Requests running\n"
        "# TYPE specserve:num_requests_running gauge\n"
        'specserve:num_requests_running{model_name="m"} 2.0\n'
    )
    merged = merge_metrics({"a": text, "b": text.replace("2.0", "3.0")}).decode()
    families = list(text_string_to_metric_families(merged))
    assert len(families) == 1
    samples = {s.labels["replica"]: s.value for s in families[0].samples}
    assert samples == {"a": 2.0, "b": 3.0}
    assert parse_gauges(text, {"specserve:num_requests_running": "running"}) == {"running": 2.0}


def _router(imbalance: int = 2):
    """The router's rule alone: Ray's request router machinery is not needed to choose."""
    from server.ray_serve.router import PrefixAffinityRouter

    router = object.__new__(PrefixAffinityRouter)
    router.initialize_state(imbalance=imbalance)
    return router


def _pending(hashes: list[str]):
    from types import SimpleNamespace
    from uuid import uuid4

    from server.ray_serve.proxied import ProxiedRequest

    return SimpleNamespace(
        args=[ProxiedRequest("POST", "/v1/chat/completions", hashes)],
        metadata=SimpleNamespace(internal_request_id=uuid4().hex),
    )


def _replicas(*names: str):
    from types import SimpleNamespace

    return [SimpleNamespace(replica_id=name, routing_stats={}) for name in names]


def _route(router, replicas, hashes: list[str]):
    """Choose, then route to the first choice, as Ray does; the replica's name."""
    import asyncio

    pending = _pending(hashes)
    best = asyncio.run(router.choose_replicas(replicas, pending))[0][0]
    router.on_request_routed(pending, best.replica_id, None)
    return best.replica_id


def test_the_router_keeps_a_prefix_on_its_replica_until_its_queue_is_too_long():
    router = _router(imbalance=2)
    a, b = _replicas("a", "b")
    holder = _route(router, [a, b], ["h1", "h2"])
    other = b if holder == "a" else a
    router.on_request_completed(holder, "r0")
    # Many requests later, each ended before the next: still the holder (the queue is empty).
    for i in range(20):
        assert _route(router, [a, b], ["h1", "h2", "h3"]) == holder
        router.on_request_completed(holder, f"r{i + 1}")
    # Three of its requests in flight, none on the other: past the imbalance, the other.
    held = a if holder == "a" else b
    router.in_flight[holder] = 3
    assert _route(router, [a, b], ["h1"]) == other.replica_id
    router.on_request_completed(other.replica_id, "x")
    # The replica's own report counts too, when it says more than this router knows.
    router.in_flight[holder] = 0
    held.routing_stats = {"running": 1, "waiting": 5}
    assert _route(router, [a, b], ["h1", "h2", "h3", "h4"]) == other.replica_id
    router.on_request_completed(other.replica_id, "y")
    held.routing_stats = {"running": 1, "waiting": 0}
    # h1's longest holder is now the other replica (it served h1..h4 last).
    assert _route(router, [a, b], ["h1", "h2", "h3", "h4"]) == other.replica_id


def test_new_conversations_arriving_together_are_shared_out_evenly():
    """Chosen but not yet routed counts as queued: eight new prefixes at once split 4 / 4."""
    import asyncio

    router = _router()
    replicas = _replicas("a", "b")
    picks = [asyncio.run(router.choose_replicas(replicas, _pending([f"conversation {i}"])))[0][0]
             for i in range(8)]  # fmt: skip
    assert sorted(p.replica_id for p in picks) == ["a"] * 4 + ["b"] * 4


# ----------------------------------------------------------------------------- real cluster


def _free_port() -> int:
    """A free port outside both the kernel's ephemeral range (32768 on), where the cluster's
    own components bind theirs while it starts (a port asked of the kernel here was once
    taken by one of them before HAProxy bound it: "Address already in use"), and Ray's
    worker ports (10002-19999)."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


@pytest.fixture(scope="module", params=PROXIES)
def cluster(request, tiny_chat_model_dir, tmp_path_factory):
    """``specserve serve --replicas 2`` on the tiny chat model: a real local Ray cluster,
    behind each of the proxies (every test below runs against both)."""
    port = _free_port()
    log = tmp_path_factory.mktemp("ray") / "serve.log"
    repo = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "tooling.cli", "serve", "--replicas", "2",
               "--replica-cpus", "0.5", "--model", str(tiny_chat_model_dir),
               "--served-model-name", "tiny", "--port", str(port),
               "--ray-proxy", request.param]  # fmt: skip
    env = {"PYTHONPATH": str(repo), "RAY_AUTH_MODE": "disabled"}
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=repo, stdout=out, stderr=subprocess.STDOUT,
                                env=os.environ | env)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                health = httpx.get(f"{base}/health", timeout=5)
                if health.status_code == 200 and len(health.json()["replicas"]) == 2:
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(2)
        else:
            pytest.fail("the Ray application did not come up:\n" + log.read_text()[-3000:])
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        # Whatever the command left (a cluster it started stops with it; this is a backstop).
        subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"],
                       capture_output=True)  # fmt: skip


def _chat(base: str, messages, stream: bool = False, max_tokens: int = 8):
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "stream": stream}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)


def test_streams_through_ray_s_proxy(cluster):
    from openai import OpenAI

    client = OpenAI(base_url=f"{cluster}/v1", api_key="unused")
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True
    ))  # fmt: skip
    assert chunks and chunks[-1].choices[0].finish_reason == "length"
    bad = httpx.post(f"{cluster}/v1/chat/completions", json={"model": "tiny"}, timeout=60)
    assert bad.status_code == 400 and "messages" in bad.text  # the replica's own validation


def test_websocket_requests_are_relayed_to_a_replica(cluster):
    import asyncio

    import websockets

    async def talk() -> list[dict]:
        url = cluster.replace("http", "ws", 1) + "/v1/ws"
        async with websockets.connect(url, subprotocols=["specserve"]) as ws:
            assert ws.subprotocol == "specserve"  # the replica's server chose it
            request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 5, "request_id": "r1"}  # fmt: skip
            await ws.send(json.dumps(request))
            await ws.send(json.dumps({"model": "tiny", "request_id": "bad"}))
            received = []
            while sum(m.get("type") in ("done", "error") for m in received) < 2:
                received.append(json.loads(await ws.recv()))
            return received

    received = asyncio.run(talk())
    chunks = [m for m in received if m.get("request_id") == "r1" and "choices" in m]
    assert chunks and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert any(m.get("type") == "done" and m["request_id"] == "r1" for m in received)
    errors = [m for m in received if m.get("type") == "error"]  # the replica's own validation
    assert [e["request_id"] for e in errors] == ["bad"]
    assert errors[0]["error"]["type"] == "invalid_request_error"


def test_a_conversation_stays_on_the_replica_holding_its_prefix(cluster):
    served: dict[int, set[str]] = {}
    for turn in range(3):
        for conversation in range(4):
            history = [{"role": "user", "content": f"conversation {conversation}: " + "x" * 700}]
            history += [{"role": "user", "content": f"turn {t}"} for t in range(turn)]
            response = _chat(cluster, history)
            assert response.status_code == 200
            served.setdefault(conversation, set()).add(response.headers[REPLICA_HEADER])
    assert all(len(replicas) == 1 for replicas in served.values()), served


def test_metrics_carry_each_replica_s_series(cluster):
    text = httpx.get(f"{cluster}/metrics", timeout=30).text
    running = [
        s for f in text_string_to_metric_families(text) for s in f.samples
        if s.name == "specserve:num_requests_running"
    ]  # fmt: skip
    assert len({s.labels["replica"] for s in running}) == 2


def _aborted(base: str) -> float:
    """Requests the replicas counted as ended by their client leaving."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples
        if s.name == "specserve:request_success_total" and s.labels["finished_reason"] == "abort"
    )  # fmt: skip


def test_a_client_that_leaves_mid_stream_aborts_its_request(cluster):
    before = _aborted(cluster)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "count"}],
            "max_tokens": 900, "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{cluster}/v1/chat/completions", json=body, timeout=120) as r:
        assert next(line for line in r.iter_lines() if line.startswith("data: "))
    deadline = time.monotonic() + 30
    while _aborted(cluster) == before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _aborted(cluster) == before + 1, "the replica did not see its client leave"


@pytest.mark.parametrize("victim", ["server", "actor"])
def test_a_replica_killed_mid_stream_ends_its_streams_cleanly(cluster, victim):
    """Its server killed: its streams end with an error event and [DONE]. Its Ray actor killed:
    the server, which streams to the ingress directly, is stopped by its tether, and its
    streams end as its shutdown ends them: finished, or with the error event; [DONE] either
    way. New requests go to the other replica at once; Ray replaces the dead one and /health
    says so, all within 60 s (a dead actor's server goes with it)."""
    import os
    import signal

    body = {"model": "tiny", "messages": [{"role": "user", "content": "count"}],
            "max_tokens": 900, "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{cluster}/v1/chat/completions", json=body, timeout=120) as r:
        replica = r.headers[REPLICA_HEADER]
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        actor_pid, server_pid = replica_processes(replica)
        os.kill(server_pid if victim == "server" else actor_pid, signal.SIGKILL)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    last = json.loads(rest[-2][6:])
    if victim == "server" or "error" in last:
        assert "error" in last
    else:
        assert last["choices"][0]["finish_reason"] == "length"
    response = _chat(cluster, [{"role": "user", "content": "still there?"}])
    assert response.status_code == 200 and response.headers[REPLICA_HEADER] != replica
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        states = httpx.get(f"{cluster}/health", timeout=10).json()["replicas"]
        if replica not in states and len(states) == 2 and all(states.values()):
            break
        time.sleep(2)
    else:
        pytest.fail(f"the killed replica was not replaced within 60 s: {states}")
    deadline = time.monotonic() + 60
    while _alive(server_pid) and time.monotonic() < deadline:
        time.sleep(1)  # a dead actor's tether stops its server (within its shutdown time)
    assert not _alive(server_pid), "the killed replica's server outlived it"


def test_a_tether_killed_outright_takes_its_server_with_it(tiny_chat_model_dir):
    """SIGKILL leaves the tether no time to stop its server: the server's death signal
    (set before it runs) stops it, and its engine process with it."""
    import os

    repo = Path(__file__).resolve().parents[1]
    port = _free_port()
    tether = subprocess.Popen(
        [sys.executable, "-m", "server.ray_serve.tethered", str(os.getpid()), "t", "serve",
         "--model", str(tiny_chat_model_dir), "--port", str(port)],
        cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        server = int(Path(f"/proc/{tether.pid}/task/{tether.pid}/children").read_text().split()[0])
        tether.kill()
        tether.wait()
        deadline = time.monotonic() + 45
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _alive(server), "the server outlived its tether"
    finally:
        tether.kill()


def test_a_replica_whose_server_cannot_start_says_why(tiny_chat_model_dir, tmp_path, capfd):
    """The replica's server runs under its tether, as in a replica: every line of its stderr
    still reaches the tether's (the worker log), and the tether writes the server's own
    reason where the replica reads it for its error (which Ray's status and then `specserve
    serve --replicas` report), not only an exit code."""
    config = tmp_path / "small_cache.yaml"
    config.write_text("kv_cache:\n  num_blocks: 4\n")
    reason_file = tmp_path / "reason"
    repo = Path(__file__).resolve().parents[1]
    tether = subprocess.Popen(
        [sys.executable, "-m", "server.ray_serve.tethered", str(os.getpid()), "t", "serve",
         "--model", str(tiny_chat_model_dir), "--config", str(config), "--port", str(_free_port())],
        cwd=repo, env={**os.environ, "PYTHONPATH": str(repo), REASON_FILE_ENV: str(reason_file)},
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    assert tether.wait(timeout=120) != 0
    reason = reason_file.read_text()
    assert reason.startswith("error: engine failed to start")
    assert "KV cache holds 64 tokens" in reason
    assert "KV cache holds 64 tokens" in capfd.readouterr().err  # relayed, not swallowed


def test_the_replicas_start_failure_is_found_in_ray_s_status_messages():
    traceback_text = (
        "The deployment failed to start 3 times in a row. Error:\n"
        "Traceback (most recent call last):\n  File \"replica.py\", line 85, in __init__\n"
        f"RuntimeError: {REPLICA_START_FAILED} with 1: error: engine failed to start: boom\n"
    )
    assert replica_start_failure(["", traceback_text]) == (
        f"{REPLICA_START_FAILED} with 1: error: engine failed to start: boom"
    )
    assert replica_start_failure(["Deploying", "the ingress failed"]) is None


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
