"""Cross-origin requests: preflight for every API route, the headers on successes and on
errors, one allowed origin with credentials on the locked server, and the same origin list
for WebSockets."""

from __future__ import annotations

import json

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.conformance.conftest import ALLOWED_ORIGIN, API_KEY, CHAT, MODEL

API_ROUTES = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/models"),
    ("GET", f"/v1/models/{MODEL}"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/health"),
    ("GET", "/version"),
    ("GET", "/metrics"),
]
PAGE = "http://page.example"


def _preflight(url: str, method: str, origin: str) -> httpx.Response:
    return httpx.options(
        url,
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": method,
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )


@pytest.mark.parametrize(("method", "path"), API_ROUTES)
def test_preflight_is_answered_for_every_route(server, method, path):
    r = _preflight(server.url + path, method, PAGE)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "*"
    assert method in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    # The middleware answers a preflight for any path: the route itself must exist too.
    body = {} if method == "POST" else None
    real = httpx.request(method, server.url + path, json=body, timeout=60)
    assert real.status_code not in (404, 405), (method, path, real.status_code)


def test_default_allows_every_origin_on_success_and_on_errors(server):
    origin = {"Origin": PAGE}
    ok = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": CHAT, "max_tokens": 1},
        headers=origin,
        timeout=60,
    )
    bad = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": CHAT, "tools": [{"type": "function"}]},
        headers=origin,
    )
    missing = httpx.get(server.url + "/v1/models/other", headers=origin)
    for response, status in ((ok, 200), (bad, 400), (missing, 404)):
        assert response.status_code == status
        assert response.headers["access-control-allow-origin"] == "*"
        assert "access-control-allow-credentials" not in response.headers


def test_streams_carry_the_headers(server):
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": CHAT, "max_tokens": 2, "stream": True},
        headers={"Origin": PAGE},
        timeout=60,
    ) as r:
        assert r.headers["access-control-allow-origin"] == "*"
        assert "data: [DONE]" in r.read().decode()


def test_locked_server_allows_only_its_origin_with_credentials(locked_server):
    url = locked_server.url + "/v1/models"
    key = {"Authorization": f"Bearer {API_KEY}"}
    allowed = httpx.get(url, headers={"Origin": ALLOWED_ORIGIN, **key})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert allowed.headers["access-control-allow-credentials"] == "true"
    other = httpx.get(url, headers={"Origin": PAGE, **key})
    assert "access-control-allow-origin" not in other.headers  # the browser blocks it
    assert _preflight(url, "GET", PAGE).status_code == 400
    assert _preflight(url, "GET", ALLOWED_ORIGIN).status_code == 200


def test_errors_reach_an_allowed_page_as_themselves(locked_server):
    """A 401 and a 413 must carry the headers, or the page sees only "failed to fetch"."""
    origin = {"Origin": ALLOWED_ORIGIN}
    url = locked_server.url + "/v1/chat/completions"
    unauthorized = httpx.post(url, json={"model": MODEL, "messages": CHAT}, headers=origin)
    assert unauthorized.status_code == 401
    assert unauthorized.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert unauthorized.json()["error"]["code"] == "invalid_api_key"
    huge = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 10_000}]}
    too_large = httpx.post(url, json=huge, headers={**origin, "Authorization": f"Bearer {API_KEY}"})
    assert too_large.status_code == 413
    assert too_large.headers["access-control-allow-origin"] == ALLOWED_ORIGIN


def test_websocket_origins_follow_the_same_list(locked_server):
    ws_url = locked_server.url.replace("http", "ws") + "/v1/ws"
    key = {"Authorization": f"Bearer {API_KEY}"}
    with pytest.raises(InvalidStatus) as caught:
        connect(ws_url, origin=PAGE, additional_headers=key).close()
    assert caught.value.response.status_code == 403
    with connect(ws_url, origin=ALLOWED_ORIGIN, additional_headers=key) as ws:
        ws.send(json.dumps({"request_id": "a", "model": MODEL, "messages": CHAT, "max_tokens": 1}))
        assert json.loads(ws.recv())["request_id"] == "a"
