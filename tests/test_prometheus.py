"""A real Prometheus (Debian's, which .ci/run installs) scrapes a real server with the project's
own docker/prometheus/prometheus.yml, and every query of the Grafana dashboard returns series
with the labels its panel shows; promtool checks the compose config and unit-tests each alert
rule (docker/prometheus/alerts_test.yml)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
from pathlib import Path

import httpx
import pytest
import yaml

from tests.server_process import ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS_DIR = ROOT / "docker" / "prometheus"
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "specserve.json"

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("promtool") is None,
    reason="Debian's prometheus (with promtool) is not installed; .ci/run installs it",
)


def test_promtool_accepts_the_compose_config_and_its_rules():
    out = subprocess.run(["promtool", "check", "config", "prometheus.yml"], cwd=PROMETHEUS_DIR,
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "7 rules found" in out.stdout + out.stderr


def test_every_alert_rule_is_unit_tested_and_passes():
    rules = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())
    names = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    tests = yaml.safe_load((PROMETHEUS_DIR / "alerts_test.yml").read_text())
    tested = {t["alertname"] for case in tests["tests"] for t in case["alert_rule_test"]}
    assert names == tested  # each rule: a case that fires and one that stays quiet
    for case in tests["tests"]:
        outcomes = {bool(t["exp_alerts"]) for t in case["alert_rule_test"]}
        assert outcomes == {True, False}, case["alert_rule_test"][0]["alertname"]
    out = subprocess.run(["promtool", "test", "rules", "alerts_test.yml"], cwd=PROMETHEUS_DIR,
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


@pytest.fixture(scope="module")
def scraped(tiny_chat_model_dir, tmp_path_factory):
    """A server (ngram decoding, the goodput policy) under a little load, and a Prometheus
    that scraped it with the project's config (its target and intervals swapped in)."""
    tmp = tmp_path_factory.mktemp("prometheus")
    server = ServerProcess(
        "--model", str(tiny_chat_model_dir), "--served-model-name", "tiny",
        "--decoder", "ngram", log_path=tmp / "server.log",
    )  # fmt: skip
    prometheus = None
    try:
        server.wait_ready()
        config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        config["rule_files"] = [str(PROMETHEUS_DIR / f) for f in config["rule_files"]]
        (job,) = config["scrape_configs"]
        job["static_configs"] = [{"targets": [f"127.0.0.1:{server.port}"]}]
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        prometheus = subprocess.Popen(
            ["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=open(tmp / "prometheus.log", "w"),  # noqa: SIM115
        )  # fmt: skip
        _load(server.url)
        time.sleep(4)  # a few scrapes after the load, so rates have two samples
        yield f"http://127.0.0.1:{port}"
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(30)
        server.stop()


def _load(url: str) -> None:
    """Finished and aborted requests, drafts that are verified (ngram on repeated text)."""
    text = "one two three four five six seven eight nine ten " * 6
    for i in range(4):
        body = {"model": "tiny", "prompt": text, "max_tokens": 24, "ignore_eos": True,
                "temperature": 0}  # fmt: skip
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        chat = {"model": "tiny", "messages": [{"role": "user", "content": f"Hi {i}"}],
                "max_tokens": 8}  # fmt: skip
        assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).status_code == 200
    body = {"model": "tiny", "prompt": text, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))  # then leave
    time.sleep(1)


def _query(prometheus: str, expr: str) -> list[dict]:
    deadline = time.monotonic() + 30
    while True:
        r = httpx.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=30)
        assert r.status_code == 200, (expr, r.text)
        result = r.json()["data"]["result"]
        if result or time.monotonic() > deadline:
            return result
        time.sleep(1)


def _panel_queries() -> list[tuple[str, str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"], t.get("legendFormat", ""))
            for p in dashboard["panels"] for t in p["targets"]]  # fmt: skip


@pytest.mark.parametrize("title, expr, legend", _panel_queries(), ids=lambda v: str(v)[:40])
def test_every_dashboard_panel_has_its_series_with_its_labels(scraped, title, expr, legend):
    concrete = expr.replace("$model", ".*").replace("$decoder", ".*").replace("$replica", ".*")
    concrete = concrete.replace("$__rate_interval", "30s")
    result = _query(scraped, concrete)
    assert result, f"{title}: no series for {concrete}"
    for label in re.findall(r"{{\s*(\w+)\s*}}", legend):
        assert all(label in series["metric"] for series in result), (title, label, result)


def test_the_dashboards_variables_find_their_values(scraped):
    dashboard = json.loads(DASHBOARD.read_text())
    for variable in dashboard["templating"]["list"]:
        if variable["name"] == "replica":
            # Only a Ray Serve application's /metrics labels replicas (tests/test_ray_serve.py);
            # "All" must then match the single server's unlabelled series too.
            assert variable["allValue"] == ".*"
            continue
        metric, label = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"]).groups()
        url = f"{scraped}/api/v1/label/{label}/values?match[]={urllib.parse.quote(metric)}"
        values = httpx.get(url, timeout=30).json()["data"]
        assert values, variable["name"]
    finished = {s["metric"]["finished_reason"] for s in _query(
        scraped, "specserve:request_success_total")}  # fmt: skip
    assert {"length", "abort"} <= finished  # the client that left is counted too
