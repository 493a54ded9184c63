"""Cross-origin requests from browsers: which pages may call the API with ``fetch()``.

vLLM's options and defaults (every origin, method and header; no credentials), set by
``--allowed-origins`` etc. or under ``server:`` in the config file. The middleware sits
outside every other layer, so errors (401, 400, 413, 500) carry the headers too and reach
the page as the error they are, not as "failed to fetch". Browsers do not apply CORS to
WebSockets; ``/v1/ws`` checks the Origin header against the same list instead.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.middleware.cors import CORSMiddleware

CONFIG_SECTION = "server"  # the config file's section for the HTTP server (EngineConfig skips it)


class CorsSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    allowed_origins: list[str] = ["*"]
    allowed_methods: list[str] = ["*"]
    allowed_headers: list[str] = ["*"]
    allow_credentials: bool = False

    def origin_allowed(self, origin: str | None) -> bool:
        """For WebSockets: no Origin header means no browser, which CORS does not restrict."""
        return origin is None or "*" in self.allowed_origins or origin in self.allowed_origins


def install_cors(app, cors: CorsSettings) -> None:
    """Add last, so that it wraps every other middleware (see the module docstring)."""
    app.add_middleware(
        CORSMiddleware,
        allow_origins=cors.allowed_origins,
        allow_methods=cors.allowed_methods,
        allow_headers=cors.allowed_headers,
        allow_credentials=cors.allow_credentials,
    )


def add_cors_arguments(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group(
        "cross-origin requests (CORS; also `server:` in the config file; flags win)"
    )
    defaults = CorsSettings()
    for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
        group.add_argument(
            "--" + name.replace("_", "-"),
            type=_string_list,
            help=f"a JSON list or comma-separated (default {json.dumps(getattr(defaults, name))})",
        )
    group.add_argument(
        "--allow-credentials",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="let pages send cookies and HTTP auth (default off)",
    )


def cors_from(args: argparse.Namespace) -> CorsSettings:
    """The config file's ``server:`` section, then the flags given on the command line."""
    settings = _from_config_file(args.config) if getattr(args, "config", None) else {}
    for name in CorsSettings.model_fields:
        value = getattr(args, name, None)
        if value is not None:
            settings[name] = value
    return CorsSettings(**settings)


def _from_config_file(path: str) -> dict:
    data = yaml.safe_load(Path(path).read_text()) or {}
    section = data.get(CONFIG_SECTION) if isinstance(data, dict) else None
    if section is None:
        return {}
    try:
        return CorsSettings.model_validate(section).model_dump(exclude_unset=True)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join([CONFIG_SECTION, *map(str, first["loc"])])
        raise ValueError(f"{path}: config key {where!r}: {first['msg']}") from None


def _string_list(text: str) -> list[str]:
    text = text.strip()
    if text.startswith("["):
        value = json.loads(text)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return value
    return [part.strip() for part in text.split(",") if part.strip()]
