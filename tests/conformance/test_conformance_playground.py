"""The browser playground (GET /playground) on a server started with ``--api-key``.

Three layers, so that machines without Chromium still check most of it:

- plain HTTP: every path the page's own script fetches exists on a keyed server, answers 401
  without the key and works with ``Authorization: Bearer KEY``;
- the page's token placement (``placeTokens``) run by Node: special tokens from provenance
  entries (``<|im_end|>``...) are never shown, and the text shown is exactly the content;
- Chromium (Playwright, as in test_conformance_browser.py): a wrong key shows the wrong-key
  message, the right key fills the model list, a message gets the API's answer, and a stream
  whose provenance carries special tokens renders only the content.

Each layer skips with its reason when its tool (Node, Chromium) is not installed.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.conformance.conftest import CHAT, MODEL, _start

KEY = "playground-key"
PAGE = Path(__file__).parents[2] / "server" / "static" / "playground.html"
SPECIAL = ("<|im_end|>", "<|im_start|>", "<|endoftext|>")


@pytest.fixture(scope="module")
def keyed_server(tiny_chat_model_dir, tmp_path_factory):
    """Only an API key: every origin allowed, so the page's same-origin fetches pass CORS."""
    proc = _start(tiny_chat_model_dir, tmp_path_factory, "--api-key", KEY)
    try:
        yield proc
    finally:
        proc.stop()


def _script(html: str) -> str:
    match = re.search(r"<script>(.*?)</script>", html, re.S)
    assert match, "the playground has no inline script"
    return match.group(1)


def _fetched(script: str) -> list[tuple[str, str]]:
    """(method, path) of every fetch() in the page's script; each must name a literal path."""
    calls = re.findall(r'fetch\(\s*"(/[^"]*)"\s*(?:,\s*\{[^}]*?method:\s*"([A-Z]+)")?', script)
    assert len(calls) == script.count("fetch("), "a fetch() whose path this test cannot read"
    return [(method or "GET", path) for path, method in calls]


# --- plain HTTP ---------------------------------------------------------------------------


def test_every_path_the_playground_fetches_needs_and_takes_the_key(keyed_server):
    page = httpx.get(keyed_server.url + "/playground", timeout=30)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    script = _script(page.text)
    assert '"Bearer "' in script  # the header the page sends the key in
    calls = _fetched(script)
    assert {("GET", "/v1/models"), ("POST", "/v1/chat/completions")} <= set(calls)
    body = {"model": MODEL, "messages": CHAT, "temperature": 0, "max_tokens": 2}
    good = {"Authorization": f"Bearer {KEY}"}
    for method, path in sorted(set(calls)):
        kwargs = {"json": body} if method == "POST" else {}
        url = keyed_server.url + path
        without = httpx.request(method, url, timeout=60, **kwargs)
        assert without.status_code == 401, (method, path, without.text)
        assert without.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.request(
            method, url, headers={"Authorization": "Bearer nope"}, timeout=60, **kwargs
        )
        assert wrong.status_code == 401, (method, path, wrong.text)
        with_key = httpx.request(method, url, headers=good, timeout=60, **kwargs)
        assert with_key.status_code == 200, (method, path, with_key.text)


# --- the page's token placement, run by Node ------------------------------------------------


def _place_tokens_source() -> str:
    match = re.search(r"// placeTokens: begin\n(.*?)// placeTokens: end", PAGE.read_text(), re.S)
    assert match, "playground.html lost its placeTokens markers"
    return match.group(1)


RENDER = """
const streams = JSON.parse(require("fs").readFileSync(0, "utf8"));
// As send() does: each chunk's pieces (one per provenance entry) and any rest, in order.
console.log(JSON.stringify(streams.map((chunks) => {
  let answer = "", shown = 0, text = "", spans = 0;
  for (const [delta, provenance] of chunks) {
    answer += delta;
    const placed = placeTokens(answer, shown, provenance);
    shown = placed.shown;
    for (const piece of placed.pieces) { text += piece.text; spans += 1; }
    text += placed.rest;
  }
  return {answer, text, spans};
})));
"""


def _tok(token: str, source: str = "plain") -> dict:
    return {"token": token, "source": source}


STREAMS = [
    # the end token comes with the last content token (hydra at temperature 0.7, issue 37)
    [["Hello", [_tok("Hello")]], [" world", [_tok(" world", "accepted"), _tok("<|im_end|>")]]],
    # ...or alone, in a chunk with no content
    [["Hi", [_tok("Hi")]], ["", [_tok("<|im_end|>", "bonus")]]],
    # other special tokens, in the middle and at the start
    [["a b", [_tok("<|im_start|>"), _tok("a"), _tok("<|endoftext|>"), _tok(" b")]]],
    # a character split across two tokens: neither token's own text is in the content
    [["", [_tok("\ufffd")]], ["\u00e9", [_tok("\ufffd", "accepted")]], ["", [_tok("<|im_end|>")]]],
    # text held back by the server and sent with a later token
    [["", [_tok("foo")]], ["foobar", [_tok("bar")]]],
    # content in a chunk without provenance; a token that is not in the content (stop string)
    [["x", []], ["y", [_tok("y"), _tok("STOP")]]],
]


def test_special_tokens_from_provenance_are_never_rendered():
    node = shutil.which("node")
    if node is None:
        pytest.skip("no Node.js installed (apt-get install nodejs)")
    program = _place_tokens_source() + RENDER
    result = subprocess.run(
        [node, "-e", program], input=json.dumps(STREAMS), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    rendered = json.loads(result.stdout)
    for chunks, out in zip(STREAMS, rendered, strict=True):
        assert out["text"] == out["answer"], chunks  # exactly the content, nothing more
        assert not any(s in out["text"] for s in SPECIAL), chunks
        assert out["spans"] == sum(len(p) for _, p in chunks)  # one span per token
    assert [o["text"] for o in rendered] == ["Hello world", "Hi", "a b", "\u00e9", "foobar", "xy"]


# --- Chromium ----------------------------------------------------------------------------------




def _wait_loaded(page, after: int) -> None:
    """Until the page's model-list load number ``after + 1`` or later has finished."""
    page.wait_for_function(f"Number(document.getElementById('model').dataset.loaded) > {after}")


def _loads(page) -> int:
    return page.evaluate("Number(document.getElementById('model').dataset.loaded || 0)")


def test_playground_behind_a_key(page, keyed_server):
    page.goto(keyed_server.url + "/")  # redirects to /playground, which needs no key
    assert page.url.endswith("/playground")
    _wait_loaded(page, 0)
    error = page.locator("#key-error")
    assert error.is_visible() and "needs an API key" in error.inner_text()
    assert page.locator("#model option").count() == 0

    # A wrong key, committed (change event): the page says the key is wrong.
    loads = _loads(page)
    page.fill("#key", "not-the-key")
    page.press("#key", "Tab")
    _wait_loaded(page, loads)
    assert error.is_visible() and "Wrong API key" in error.inner_text()
    assert page.locator("#model option").count() == 0

    # The right key, only typed (input event): the lists fill and the message goes.
    loads = _loads(page)
    page.fill("#key", KEY)
    _wait_loaded(page, loads)
    assert page.locator("#model option").all_inner_texts() == [MODEL]
    assert page.locator("#decoder option").count() >= 1
    assert error.is_hidden()

    page.fill("#temperature", "0")
    page.fill("#max_tokens", "8")
    page.fill("#prompt", CHAT[0]["content"])
    page.click("#send")
    answer = page.locator(".turn .text[data-done=true]")
    answer.wait_for(timeout=60_000)
    expected = httpx.post(
        keyed_server.url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": MODEL, "messages": CHAT, "temperature": 0, "max_tokens": 8},
        timeout=60,
    ).json()["choices"][0]["message"]["content"]
    assert answer.text_content() == expected
    assert page.locator(".turn .text.error").count() == 0
    assert (
        page.locator(".turn .stats")
        .last.inner_text()
        .startswith(f"{answer.locator('span.tok').count()} tokens")
    )

    # The key goes wrong again: sending says so, in the turn and under the key field.
    page.fill("#key", "not-the-key-either")
    page.press("#key", "Tab")
    page.wait_for_function("document.getElementById('key-error').textContent.includes('Wrong')")
    page.fill("#prompt", "Hi")
    page.click("#send")
    page.locator(".turn .text.error").wait_for(timeout=30_000)
    assert error.is_visible() and "Wrong API key" in error.inner_text()


def _sse(chunks: list[dict]) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def test_the_page_never_renders_special_tokens(page, keyed_server):
    """A stream whose provenance names special tokens (as SmolLM2's end token reaches it):
    the page shows the content and nothing else."""
    content = ["Hel", "lo", " there"]

    def chunk(delta: str, provenance: list[dict], finish=None) -> dict:
        choice = {"index": 0, "delta": {"content": delta} if delta else {}, "finish_reason": finish}
        return {"object": "chat.completion.chunk", "model": MODEL,
                "choices": [{**choice, "provenance": provenance}]}  # fmt: skip

    stream = _sse(
        [
            chunk("", [_tok("<|im_start|>")]),
            chunk(content[0], [_tok(content[0])]),
            chunk(content[1], [_tok(content[1], "accepted"), _tok("<|endoftext|>", "bonus")]),
            chunk(content[2], [_tok(content[2], "resampled"), _tok("<|im_end|>")], "stop"),
        ]
    )
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(status=200, content_type="text/event-stream", body=stream),
    )
    page.goto(keyed_server.url + "/playground")
    page.fill("#key", KEY)
    page.press("#key", "Tab")
    page.wait_for_function("document.querySelectorAll('#model option').length >= 1")
    page.fill("#prompt", "Hi")
    page.click("#send")
    answer = page.locator(".turn .text[data-done=true]")
    answer.wait_for(timeout=30_000)
    assert answer.text_content() == "".join(content)
    html = page.locator("#log").inner_html()  # (the page's script mentions them, in comments)
    assert not any(s in html for s in SPECIAL)
    assert not any(s in page.locator("body").inner_text() for s in SPECIAL)
    assert answer.locator("span.tok").count() == 6  # every token still counted and coloured
