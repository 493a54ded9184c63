"""The Ray bench's CPU accounting: each process of a deployment gets its role, and a real
server's processes are found and counted."""

from __future__ import annotations

from tooling.bench.process_cpu import ROLES, _Process, cpu_by_role, role_of, spent


def _table() -> dict[int, _Process]:
    py = "/venv/bin/python"
    return {
        1: _Process("python", f"{py} -m tooling.cli serve --port 8000 --replicas 2", 0, 1.0),
        2: _Process("ray::ProxyActor", "ray::ProxyActor", 1, 2.0),
        3: _Process("ray::ServeRepli", "ray::ServeReplica:specserve:specserve-ingress", 1, 3.0),
        4: _Process("ray::ServeRepli", "ray::ServeReplica:specserve:specserve-replica", 1, 4.0),
        5: _Process("python", f"{py} -m tooling.cli serve --threads 1 --host 127.0.0.1", 4, 5.0),
        6: _Process("python", f"{py} -B -c from multiprocessing.spawn import spawn_main", 5, 6.0),
        7: _Process("gcs_server", "/venv/lib/ray/core/src/ray/gcs/gcs_server --log_dir=x", 1, 7.0),
        8: _Process("python", f"{py} -B -c from multiprocessing.spawn import spawn_main", 9, 8.0),
        9: _Process("bash", "bash", 0, 9.0),
    }


def test_each_process_of_a_deployment_gets_its_role():
    table = _table()
    roles = {pid: role_of(pid, table) for pid in table}
    assert roles == {
        1: "Ray's other processes",  # the driver of `serve --replicas`
        2: "Ray proxy",
        3: "ingress",
        4: "replica actors",
        5: "servers",
        6: "engines",
        7: "Ray's other processes",
        8: None,  # spawned by something that is not a server
        9: None,
    }


def test_spent_goes_process_by_process():
    before = {(10, 1): ("engines", 2.0), (11, 1): ("engines", 5.0), (12, 1): ("servers", 1.0)}
    # 11 ended, 13 began, and pid 12 is now another process (another start time).
    after = {(10, 1): ("engines", 3.5), (13, 9): ("engines", 0.5), (12, 7): ("servers", 0.25)}
    used = spent(before, after)
    assert set(used) == set(ROLES)
    assert used["engines"] == 2.0 and used["servers"] == 0.25 and used["ingress"] == 0.0


def test_a_live_server_and_its_engine_are_counted(tiny_server):
    import httpx

    before = cpu_by_role()
    body = {"model": "tiny", "prompt": "Once", "max_tokens": 64, "ignore_eos": True}
    assert httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    after = cpu_by_role()
    roles = {role for role, _ in after.values()}
    assert {"servers", "engines"} <= roles
    assert spent(before, after)["engines"] > 0  # the engine generated those tokens
