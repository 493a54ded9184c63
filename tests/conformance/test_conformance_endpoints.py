"""The endpoints clients and load balancers probe: models, version, tokenize, health."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conformance.conftest import CHAT, MODEL


def test_models_list_and_retrieve(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model" and card.owned_by == "specserve"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    body = caught.value.body
    assert body["code"] == "model_not_found" and "no-such-model" in body["message"]


def test_an_unknown_model_in_a_request_is_a_404(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=CHAT)


def test_version(server):
    from importlib.metadata import version

    r = httpx.get(server.url + "/version")
    assert r.status_code == 200 and r.json() == {"version": version("specserve")}


def test_health_answers_get_and_head(server):
    assert httpx.get(server.url + "/health").status_code == 200
    head = httpx.head(server.url + "/health")
    assert head.status_code == 200 and head.content == b""


def test_tokenize_and_detokenize_round_trip(server):
    r = httpx.post(
        server.url + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}
    )
    body = r.json()
    assert r.status_code == 200 and body["count"] == len(body["tokens"]) >= 2
    assert body["max_model_len"] == 1024 and len(body["token_strs"]) == body["count"]
    back = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert back.json() == {"prompt": "Hello world"}


def test_tokenize_a_chat_counts_what_a_completion_counts(server, client):
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": CHAT})
    assert r.json()["token_strs"] is None
    completion = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert r.json()["count"] == completion.usage.prompt_tokens


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "colour": 1}, "colour"),
        ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_tokenize_errors_are_openai_shaped(server, path, body, param):
    r = httpx.post(server.url + path, json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_metrics_are_prometheus_text(server):
    r = httpx.get(server.url + "/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    assert "# TYPE specserve:num_requests_running gauge" in r.text
