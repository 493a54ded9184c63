"""The compose stack and the Grafana dashboard: every metric the dashboard queries is one a
real server exports (scraped after real requests, a drafting decoder included), and the
compose file wires the services to files that exist. No docker here: the YAML is parsed and
checked instead of running `docker compose config`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).parents[1]
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "specserve.json"


def _queried_metrics() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"]]
    return set(re.findall(r"specserve:[a-z_]+", " ".join(exprs)))


@pytest.fixture(scope="module")
def scraped(tiny_chat_model_dir, tmp_path_factory) -> str:
    from tests.server_process import ServerProcess

    proc = ServerProcess(
        "--model", str(tiny_chat_model_dir), "--served-model-name", "tiny",
        "--extra-decoders", "ngram", "--draft-policy", "goodput",
        log_path=tmp_path_factory.mktemp("server") / "server.log",
    )  # fmt: skip
    try:
        proc.wait_ready()
        # A prompt that repeats and a bias that keeps it repeating: prompt lookup drafts,
        # and its drafts are accepted, so every speculation series has samples.
        for speculative in (None, {"method": "ngram"}):
            body = {"model": "tiny", "prompt": [42] * 8, "max_tokens": 24, "temperature": 0,
                    "ignore_eos": True, "logit_bias": {"42": 100}}  # fmt: skip
            if speculative:
                body["speculative"] = speculative
            r = httpx.post(proc.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
        return httpx.get(proc.url + "/metrics").text
    finally:
        proc.stop()


def test_every_metric_the_dashboard_queries_is_exported(scraped):
    exported = set(re.findall(r"^(specserve:[a-z_]+)", scraped, flags=re.M))
    queried = _queried_metrics()
    assert len(queried) >= 15
    assert queried <= exported, sorted(queried - exported)


def test_dashboard_panels_are_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "prometheus" and panel["targets"]
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")")


def test_compose_stack_wires_existing_files():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"specserve", "prometheus", "grafana"}
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert (ROOT / source).exists(), volume
    scrape = yaml.safe_load((ROOT / "docker/prometheus/prometheus.yml").read_text())
    targets = scrape["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["specserve:8000"] and "8000:8000" in services["specserve"]["ports"]
    datasource = yaml.safe_load(
        (ROOT / "docker/grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"][0]
    assert datasource["uid"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
