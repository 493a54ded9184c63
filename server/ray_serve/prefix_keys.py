"""What the router knows of a request's prefix: hashes of its leading blocks of prompt text.

A replica's prefix cache holds the KV of the prompts it served, in blocks. The router cannot
tokenize (the replicas own the tokenizer), so it cuts the request's prompt text, as the chat
template would lay it out in order (roles and contents), into blocks of ``BLOCK_CHARS``
characters and hashes them as a chain: hash i covers the first i + 1 blocks. Two requests
sharing a conversation's history share their leading hashes, and the replica that served the
longest run of them most likely still holds that prefix. Only whole blocks count (a partial
last block is not a reusable prefix, as in the KV cache).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

BLOCK_CHARS = 256  # about 64 tokens of English: four KV blocks of 16
MAX_BLOCKS = 256  # prompts longer than this are keyed by their first 64k characters


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(
            part.get("text", "") if isinstance(part, dict) else str(part) for part in content
        )
    return json.dumps(content, sort_keys=True)


def prompt_text(body: dict) -> str:
    """The request's prompt as the router keys it: chat messages in order with their roles
    (and tool calls), or a completion's prompt (its first one if several)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for message in messages:
            if not isinstance(message, dict):
                continue
            parts.append(f"<|{message.get('role', '')}|>{_content_text(message.get('content'))}")
            if message.get("tool_calls"):
                parts.append(json.dumps(message["tool_calls"], sort_keys=True))
        return "\n".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0]  # one of several prompts: the first keys the request
    if isinstance(prompt, list):  # token ids
        return " ".join(str(t) for t in prompt)
    return prompt if isinstance(prompt, str) else ""


def prefix_hashes(text: str, block: int = BLOCK_CHARS) -> list[str]:
    """Chained hashes of ``text``'s whole leading blocks: entry i covers blocks 0..i."""
    hashes, digest = [], b""
    for start in range(0, min(len(text), block * MAX_BLOCKS) - block + 1, block):
        digest = hashlib.blake2b(
            digest + text[start : start + block].encode("utf-8", "surrogatepass"), digest_size=12
        ).digest()
        hashes.append(digest.hex())
    return hashes


def request_prefix_hashes(body: bytes) -> list[str]:
    """The prefix hashes of a raw JSON request body (none for a body that is not one)."""
    try:
        parsed = json.loads(body or b"{}")
    except ValueError:
        return []
    return prefix_hashes(prompt_text(parsed)) if isinstance(parsed, dict) else []
