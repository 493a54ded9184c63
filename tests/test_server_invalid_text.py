"""A lone UTF-16 surrogate anywhere in a request ("\\ud800" in the JSON) is a 400 naming the
field, streaming or not, on every endpoint that reads text; it never reaches the tokenizer."""

from __future__ import annotations

import httpx
import pytest

from tests.test_server_errors import assert_openai_error

CHAT = '"messages": [{"role": "user", "content": "hi \\ud800 there"}]'


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", f'{{"model": "tiny", {CHAT}, "max_tokens": 2}}',
         "messages[0].content"),
        ("/v1/chat/completions", f'{{"model": "tiny", {CHAT}, "max_tokens": 2, "stream": true}}',
         "messages[0].content"),
        ("/v1/completions", '{"model": "tiny", "prompt": "a\\udc00b", "max_tokens": 2}', "prompt"),
        ("/v1/completions", '{"model": "tiny", "prompt": ["ok", "\\udbff"], "stream": true}',
         "prompt[1]"),
        ("/v1/completions", '{"model": "tiny", "prompt": "ab", "stop": ["\\udc00"]}', "stop[0]"),
        ("/tokenize", f'{{"model": "tiny", {CHAT}}}', "messages[0].content"),
        ("/tokenize", '{"model": "tiny", "prompt": "\\ud800"}', "prompt"),
    ],
)  # fmt: skip
def test_a_lone_surrogate_is_a_400_naming_the_field(tiny_server, path, body, param):
    r = httpx.post(tiny_server.url + path, content=body,
                   headers={"content-type": "application/json"}, timeout=60)  # fmt: skip
    err = assert_openai_error(r, 400, param=param)
    assert "lone UTF-16 surrogate" in err["message"] and err["code"] == "invalid_value"


def test_a_paired_surrogate_is_valid_text(tiny_server):
    body = '{"model": "tiny", "prompt": "smile \\ud83d\\ude00", "max_tokens": 2}'  # an emoji
    r = httpx.post(tiny_server.url + "/v1/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
