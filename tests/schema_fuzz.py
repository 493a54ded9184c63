"""Fuzzing from the server's own OpenAPI schema (schemathesis): bodies for every operation and
field the schema declares, each sent to a real server. The property: never a 5xx, never a
hung connection, and every error in OpenAI's shape.

    .venv/bin/python -m tests.schema_fuzz --bodies 2000     # the soak (prints a summary)

tests/test_server_schema_fuzz.py runs a short version in the suite.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# Streams are read to their end; a connection that stays silent this long is a hang.
READ_TIMEOUT_S = 60.0
# Valid but large amounts of work are capped (invalid values are sent as drawn: refusing them
# is what is under test); a generation without a length gets a short one.
CAPS = {"max_tokens": 16, "max_completion_tokens": 16, "n": 2, "best_of": 2, "logprobs": 5,
        "top_logprobs": 5, "prompt_logprobs": 2}  # fmt: skip
GENERATING = ("/v1/completions", "/v1/chat/completions")


def operations(base_url: str):
    import schemathesis

    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    return [
        result.ok()
        for result in schema.get_all_operations()
        if result.ok().method.upper() in ("POST", "GET")
        and not result.ok().path.startswith("/playground")
    ]


def check_response(case, response: httpx.Response, body: bytes) -> str:
    """The property, for one exchange; returns a short outcome for the summary."""
    where = f"{case.method} {case.path} {json.dumps(case.body, default=str)[:300]}"
    assert response.status_code < 500, f"{response.status_code} for {where}: {body[:500]!r}"
    if response.status_code >= 400:
        error = json.loads(body)["error"]
        assert isinstance(error["message"], str) and error["message"], where
        assert {"message", "type", "param", "code"} <= set(error), where
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", f"a stream without [DONE]: {where}"
    return f"{case.path} {response.status_code}"


def send(base_url: str, case, model: str) -> tuple[httpx.Response, bytes]:
    body = case.body
    if type(body).__name__ == "NotSet":  # an operation without a body (GET)
        body = None
    if isinstance(body, dict):  # keep the work per body small: the property is about shapes
        body = dict(body)
        for key, cap in CAPS.items():
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > cap:
                body[key] = cap
        if case.path in GENERATING and "max_tokens" not in body:
            body["max_tokens"] = 8
        # The served model's name: a drawn one only meets the 404 (tested elsewhere), and the
        # fields behind it would go unexercised.
        body["model"] = model
    timeout = httpx.Timeout(10.0, read=READ_TIMEOUT_S)
    with httpx.Client(base_url=base_url, timeout=timeout) as client:
        query = case.query if isinstance(case.query, dict) else None
        request = client.build_request(case.method, case.formatted_path, json=body,
                                       params=query or None)  # fmt: skip
        response = client.send(request, stream=True)
        try:
            data = response.read()
        finally:
            response.close()
    return response, data


def fuzz(base_url: str, bodies: int, seed: int = 0) -> collections.Counter:
    """Send ``bodies`` generated requests; raises AssertionError at the first that breaks the
    property. Returns how many of each (path, status) there were."""
    ops = operations(base_url)
    model = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    outcomes: collections.Counter = collections.Counter()

    @settings(max_examples=bodies, deadline=None, database=None, derandomize=seed == 0,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(st.one_of([op.as_strategy() for op in ops]))
    def one(case):
        response, data = send(base_url, case, model)
        outcomes[check_response(case, response, data)] += 1

    one()
    return outcomes


def main() -> int:
    from tests.server_process import ServerProcess

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bodies", type=int, default=2000)
    parser.add_argument("--url", help="a running server (default: start one on the default model)")
    args = parser.parse_args()
    server = None
    if args.url is None:
        server = ServerProcess()
        server.wait_ready()
    try:
        outcomes = fuzz(args.url or server.url, args.bodies)
    finally:
        if server is not None:
            server.stop()
    total = sum(outcomes.values())
    print(f"{total} bodies, no 5xx, every error in OpenAI's shape, every stream ended:")
    for outcome, count in sorted(outcomes.items()):
        print(f"  {count:6d}  {outcome}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
