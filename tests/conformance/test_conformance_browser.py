"""A real browser (Playwright driving Debian's Chromium) on a page from another origin that
streams a chat completion with fetch() and over the WebSocket, as chat front ends do.

Skips with the reason when no Chromium is installed (Playwright's own browser download is
not reachable here; `.ci/run` installs Debian's `chromium` when it can).
"""

from __future__ import annotations

import functools
import http.server
import os
import threading
from pathlib import Path

import pytest

from tests.conformance.conftest import CHAT, MODEL, _start

PAGES = Path(__file__).parent / "pages"
KEY = "browser-key"
BODY = {"model": MODEL, "messages": CHAT, "temperature": 0, "max_tokens": 8}




@pytest.fixture(scope="module")
def page_origin():
    """The page's own origin: a static file server on another port."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(PAGES))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def guarded_server(tiny_chat_model_dir, tmp_path_factory, page_origin):
    """Only the page's origin (as 127.0.0.1) is allowed, with a key."""
    proc = _start(
        tiny_chat_model_dir,
        tmp_path_factory,
        "--allowed-origins",
        f"http://127.0.0.1:{page_origin}",
        "--api-key",
        KEY,
    )
    try:
        yield proc
    finally:
        proc.stop()


def _open(page, host: str, port: int):
    page.goto(f"http://{host}:{port}/client.html")
    return page


def test_a_page_on_another_origin_streams_a_chat(page, server, page_origin, client):
    expected = client.chat.completions.create(**BODY).choices[0].message.content
    _open(page, "127.0.0.1", page_origin)
    streamed = page.evaluate("([api, body]) => streamChat(api, body)", [server.url, BODY])
    assert streamed["status"] == 200 and streamed["done"] and streamed["chunks"] >= 2
    assert streamed["text"] == expected
    over_socket = page.evaluate("([api, body]) => socketChat(api, body)", [server.url, BODY])
    assert over_socket == {"text": expected}


def test_errors_reach_the_page_as_errors(page, server, page_origin):
    _open(page, "127.0.0.1", page_origin)
    refused = page.evaluate(
        "([api, body]) => streamChat(api, body)", [server.url, {**BODY, "tools": [{"type": "x"}]}]
    )
    assert refused["status"] == 400 and refused["error"]["param"] == "tools"


def test_only_the_allowed_origin_gets_through(page, guarded_server, page_origin):
    url = guarded_server.url
    _open(page, "127.0.0.1", page_origin)  # allowed
    ok = page.evaluate("([api, body, key]) => streamChat(api, body, key)", [url, BODY, KEY])
    assert ok["status"] == 200 and ok["text"]
    no_key = page.evaluate("([api, body]) => streamChat(api, body)", [url, BODY])
    assert no_key["status"] == 401 and no_key["error"]["code"] == "invalid_api_key"
    socket = page.evaluate("([api, body, key]) => socketChat(api, body, key)", [url, BODY, KEY])
    assert socket["text"] == ok["text"]

    _open(page, "localhost", page_origin)  # the same server by another name: another origin
    from playwright.sync_api import Error as PlaywrightError

    with pytest.raises(PlaywrightError, match="Failed to fetch"):
        page.evaluate("([api, body, key]) => streamChat(api, body, key)", [url, BODY, KEY])
    with pytest.raises(PlaywrightError, match="WebSocket failed"):
        page.evaluate("([api, body, key]) => socketChat(api, body, key)", [url, BODY, KEY])


ARTIFACTS = Path(
    os.environ.get("SPECSERVE_TEST_ARTIFACTS", Path(__file__).parents[2] / "test-artifacts")
)


@pytest.fixture(scope="module")
def drafting_server(tiny_chat_model_dir, tmp_path_factory):
    """A server that loads a draft model next to the tiny chat model, so speculation shows."""
    import shutil as sh

    from tests.tiny_models import save_perturbed_copy

    draft = save_perturbed_copy(tiny_chat_model_dir, tmp_path_factory.mktemp("draft") / "m", 0.02)
    sh.copy(tiny_chat_model_dir / "tokenizer.json", draft / "tokenizer.json")
    proc = _start(
        tiny_chat_model_dir, tmp_path_factory, "--extra-decoders", "draft",
        "--draft-model", str(draft), "--draft-policy", "fixed",
    )  # fmt: skip
    try:
        yield proc
    finally:
        proc.stop()


def test_playground_streams_and_colours_tokens_by_provenance(page, drafting_server):
    page.goto(drafting_server.url + "/")  # redirects to /playground
    assert page.url.endswith("/playground")
    page.wait_for_function("document.querySelectorAll('#decoder option').length >= 2")
    page.select_option("#decoder", "draft")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "40")
    page.fill("#prompt", "Tell me a story about a lighthouse.")
    page.click("#send")
    answer = page.locator(".turn .text[data-done=true]")
    answer.wait_for(timeout=60_000)
    spans = answer.locator("span.tok")
    sources = spans.evaluate_all("spans => spans.map(s => s.className.split(' ')[1])")
    assert len(sources) == 40 and set(sources) <= {"plain", "accepted", "resampled", "bonus"}
    assert "accepted" in sources  # the draft model's drafts are often accepted
    stats = page.locator(".turn .stats").last.inner_text()
    assert "40 tokens" in stats and "tokens per step" in stats
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "playground.png"), full_page=True)


def test_playground_shows_errors(page, server):
    page.goto(server.url + "/playground")
    page.wait_for_function("document.querySelectorAll('#model option').length >= 1")
    page.fill("#max_tokens", "100000")  # beyond the context: a 400 the page must show
    page.fill("#prompt", "Hi")
    page.click("#send")
    error = page.locator(".turn .text.error")
    error.wait_for(timeout=30_000)
    assert "maximum context length" in error.inner_text()
