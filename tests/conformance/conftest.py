"""The conformance suite: the official ``openai`` client (and plain HTTP where the client has
no method) against a real ``specserve serve`` process, written from the OpenAI API reference
and vLLM's documented behaviour rather than from our code.

Two servers for the whole suite: an open one (the defaults: every origin allowed, no keys)
and a locked one (one allowed origin, credentials, an API key, a small body limit); a third,
whose tokenizer adds a BOS token, starts only for the tests of ``add_special_tokens``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import openai
import pytest

MODEL = "tiny"
API_KEY = "conformance-key"
ALLOWED_ORIGIN = "http://allowed.example"
CHAT = [{"role": "user", "content": "Say something."}]
BOS = 1  # the bos_server tokenizer's BOS: SmolLM2's <|im_start|>


def _start(tiny_chat_model_dir, tmp_path_factory, *extra: str):
    from tests.server_process import ServerProcess

    proc = ServerProcess(
        "--model",
        str(tiny_chat_model_dir),
        "--served-model-name",
        MODEL,
        *extra,
        log_path=tmp_path_factory.mktemp("server") / "server.log",
    )
    try:
        proc.wait_ready()
    except BaseException:
        proc.stop()
        raise
    return proc


@pytest.fixture(scope="package")
def server(tiny_chat_model_dir, tmp_path_factory):
    proc = _start(tiny_chat_model_dir, tmp_path_factory)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="package")
def locked_server(tiny_chat_model_dir, tmp_path_factory):
    proc = _start(
        tiny_chat_model_dir,
        tmp_path_factory,
        "--api-key",
        API_KEY,
        "--allowed-origins",
        f'["{ALLOWED_ORIGIN}"]',
        "--allow-credentials",
        "--max-body-bytes",
        "4096",
    )
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="package")
def bos_server(tiny_chat_model_dir, tmp_path_factory):
    """The open server's model with a tokenizer that puts BOS (``<|im_start|>``, id 1) first
    whenever it adds special tokens. SmolLM2's adds none, so there ``add_special_tokens``
    could be ignored and no test would see it."""
    path = tmp_path_factory.mktemp("bos-model")
    for source in tiny_chat_model_dir.iterdir():
        (path / source.name).symlink_to(source)
    tokenizer = json.loads((tiny_chat_model_dir / "tokenizer.json").read_text())
    name = "<|im_start|>"
    bos = {"SpecialToken": {"id": name, "type_id": 0}}
    a, b = ({"Sequence": {"id": seq, "type_id": i}} for i, seq in enumerate("AB"))
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, a],
        "pair": [bos, a, b],
        "special_tokens": {name: {"id": name, "ids": [BOS], "tokens": [name]}},
    }
    (path / "tokenizer.json").unlink()
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    proc = _start(path, tmp_path_factory)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="package")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="package")
def bos_client(bos_server):
    return openai.OpenAI(base_url=bos_server.url + "/v1", api_key="unused", max_retries=0)


def greedy(**kw):
    return {"temperature": 0, "max_tokens": 8, **kw}


def tokenize(server, **body) -> list[int]:
    """vLLM's /tokenize on ``server``: a ``prompt``, or ``messages`` with the chat options."""
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


# ---- the browser tests' fixtures (test_conformance_browser.py, _playground.py) --------------
def chromium_path() -> str | None:
    """Debian's Chromium (or another local one); Playwright cannot download its own here."""
    candidates = [
        os.environ.get("SPECSERVE_CHROMIUM"),
        "/usr/lib/chromium/chromium",  # Debian's binary (/usr/bin/chromium is a shell wrapper)
        shutil.which("chromium"),
        shutil.which("chromium-browser"),
        shutil.which("google-chrome"),
    ]
    return next((c for c in candidates if c and Path(c).is_file()), None)


@pytest.fixture(scope="module")
def browser():
    """Playwright's sync API for this module only: it keeps an event loop marked running on
    the main thread while it lives, which would break every later test that calls
    asyncio.run (so not pytest-playwright's session-wide fixtures)."""
    path = chromium_path()
    if path is None:
        pytest.skip(
            "no Chromium installed (apt-get install chromium); Playwright cannot download one here"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=path)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context()
    try:
        yield context.new_page()
    finally:
        context.close()
