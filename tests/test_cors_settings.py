"""CORS settings from the config file and flags, and the middleware order that puts the
headers on every response, an unexpected 500 included."""

from __future__ import annotations

import argparse

import pytest
from fastapi.testclient import TestClient

from engine.config import EngineConfig
from server.cors import CorsSettings, add_cors_arguments, cors_from


def _args(argv: list[str], config: str | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cors_arguments(parser)
    args = parser.parse_args(argv)
    args.config = config
    return args


def test_defaults_are_vllms():
    cors = cors_from(_args([]))
    assert cors == CorsSettings(
        allowed_origins=["*"], allowed_methods=["*"], allowed_headers=["*"], allow_credentials=False
    )


def test_config_file_section_then_flags(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        "model: m\nserver:\n  allowed_origins: [https://a.example]\n  allow_credentials: true\n"
    )
    from_file = cors_from(_args([], str(config)))
    assert from_file.allowed_origins == ["https://a.example"] and from_file.allow_credentials
    flags = cors_from(
        _args(
            ["--allowed-origins", "https://b.example, https://c.example", "--no-allow-credentials"],
            str(config),
        )
    )
    assert flags.allowed_origins == ["https://b.example", "https://c.example"]
    assert not flags.allow_credentials
    assert _args(["--allowed-methods", '["GET", "POST"]']).allowed_methods == ["GET", "POST"]
    # The engine reads the same file and leaves the server's section alone.
    assert EngineConfig.from_yaml(config).model == "m"


def test_a_bad_server_section_names_the_key(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("server:\n  allowed_origin: [x]\n")
    with pytest.raises(ValueError, match="server.allowed_origin"):
        cors_from(_args([], str(config)))


def test_origin_check_for_websockets():
    locked = CorsSettings(allowed_origins=["https://a.example"])
    assert locked.origin_allowed("https://a.example") and locked.origin_allowed(None)
    assert not locked.origin_allowed("https://b.example")
    assert CorsSettings().origin_allowed("https://anything.example")


def test_an_unexpected_error_is_a_500_with_the_cors_headers():
    """Fault injection: a route that raises; the engine is never started (no lifespan)."""
    from server.app import create_app
    from server.state import ServerSettings

    app = create_app(ServerSettings(config=EngineConfig()))

    @app.get("/boom")
    async def boom():
        raise RuntimeError("injected")

    r = TestClient(app, raise_server_exceptions=False).get(
        "/boom", headers={"Origin": "https://page.example"}
    )
    assert r.status_code == 500 and r.json()["error"]["type"] == "internal_server_error"
    assert r.headers["access-control-allow-origin"] == "*"
