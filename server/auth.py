"""API keys: how a request presents one, and how it is checked.

HTTP requests send ``Authorization: Bearer <key>``; the scheme is case-insensitive (RFC 7235),
and a bare key without the scheme is refused. A WebSocket sends the same header, or, from a
browser (whose WebSocket API cannot set headers), offers two subprotocols: ``specserve`` and
``bearer.<key as unpadded base64url>``; the server selects ``specserve``, so the key is never
echoed back. Keys are compared in constant time against every configured key
(``hmac.compare_digest``), so response times say nothing about which key, or how much of one,
matched. Keys are never logged.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Sequence

WEBSOCKET_SUBPROTOCOL = "specserve"
KEY_SUBPROTOCOL_PREFIX = "bearer."


def bearer_token(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header; None for any other header."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def subprotocol_token(subprotocols: Sequence[str]) -> str | None:
    """The key a browser offered as the ``bearer.<base64url key>`` subprotocol, if any."""
    for offered in subprotocols:
        if offered.startswith(KEY_SUBPROTOCOL_PREFIX):
            encoded = offered.removeprefix(KEY_SUBPROTOCOL_PREFIX)
            padded = encoded + "=" * (-len(encoded) % 4)
            try:
                key = base64.b64decode(padded, altchars=b"-_", validate=True).decode()
            except (binascii.Error, UnicodeDecodeError):
                return None
            return key or None
    return None


def key_subprotocol(key: str) -> str:
    """The subprotocol that carries ``key`` (for clients, and for the docs' example)."""
    return KEY_SUBPROTOCOL_PREFIX + base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


def key_is_valid(token: str | None, keys: Sequence[str]) -> bool:
    """Whether ``token`` is one of ``keys``, comparing against every key in constant time."""
    presented = (token or "").encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented, key.encode())
    return matched and bool(token)  # an empty token is never a key
