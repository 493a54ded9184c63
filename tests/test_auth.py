"""API key checks (server/auth.py): the Bearer scheme, the WebSocket subprotocol, constant-time
comparison against every key. The running server's answers are in tests/test_server_errors.py."""

from __future__ import annotations

import hmac

from server import auth


def test_bearer_scheme_is_case_insensitive_and_required():
    assert auth.bearer_token("Bearer k1") == "k1"
    assert auth.bearer_token("bearer k1") == "k1" and auth.bearer_token("BEARER  k1 ") == "k1"
    assert auth.bearer_token("k1") is None  # a bare key is not a credential
    assert auth.bearer_token("Basic k1") is None and auth.bearer_token("Bearer ") is None
    assert auth.bearer_token(None) is None


def test_key_subprotocol_round_trips_any_key():
    for key in ["sk-test", "a/b+c=d", "ключ"]:
        offered = ["specserve", auth.key_subprotocol(key)]
        assert "=" not in offered[1] and auth.subprotocol_token(offered) == key
    assert auth.subprotocol_token(["specserve"]) is None
    assert auth.subprotocol_token(["bearer.%%%"]) is None


def test_every_key_is_compared_in_constant_time(monkeypatch):
    calls, compare = [], hmac.compare_digest

    def counting(a, b):
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    keys = ["first", "second", "third"]
    assert auth.key_is_valid("first", keys)  # a match on the first key still compares all
    assert len(calls) == 3
    assert not auth.key_is_valid("fourth", keys) and not auth.key_is_valid(None, keys)
    assert not auth.key_is_valid("", [""])  # no token is never a key
