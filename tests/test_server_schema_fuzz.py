"""A short run of the schema-driven fuzz (tests/schema_fuzz.py) against a real server: bodies
drawn from the server's own OpenAPI schema, every field of every operation; never a 5xx, never
a hung connection, every error in OpenAI's shape. The soak runs 2000 and more."""

from __future__ import annotations

import pytest

pytest.importorskip("schemathesis", reason="schemathesis is a dev extra (pip install -e .[dev])")


def test_bodies_from_the_schema_never_get_a_5xx(tiny_server):
    from tests.schema_fuzz import fuzz, operations

    paths = {op.path for op in operations(tiny_server.url)}
    assert {"/v1/chat/completions", "/v1/completions", "/tokenize"} <= paths
    outcomes = fuzz(tiny_server.url, bodies=120)
    assert sum(outcomes.values()) >= 100
    assert any(" 200" in o for o in outcomes) and any(" 400" in o for o in outcomes)
