"""A user's own conversations (JSONL) as requests for the target to answer.

Each line is one conversation, in OpenAI's shape (``{"messages": [{"role": ..., "content":
...}]}``) or ShareGPT's (``{"conversations": [{"from": "human", "value": ...}]}``). The
assistant turns in the file are not trained on: the target regenerates each of them after the
user turns before it (self-distillation, as SpecForge and Medusa-2 do), so the drafter learns
what this target says. A line that is not such a conversation is an error naming the line;
a conversation with no user message is skipped and counted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tooling.training.prompt_mix import Request

SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
    "system": "system",
}  # fmt: skip
OPENAI_ROLES = ("system", "developer", "user", "assistant")


@dataclass
class ConversationsFile:
    """The requests of a file, and how many of its lines were passed over and why."""

    requests: list[Request]
    skipped: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        told = ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items()))
        return f"{len(self.requests)} conversations" + (f" (skipped: {told})" if told else "")


def read_conversations(path: str | Path) -> ConversationsFile:
    """The conversations of a JSONL file; ValueError naming the file and line of a bad one."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    result = ConversationsFile([])
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                _count(result, "blank lines")
                continue
            try:
                messages = _messages(json.loads(line))
            except (ValueError, TypeError, KeyError, AttributeError) as e:
                raise ValueError(f"{path}:{number}: {e}") from None
            request = _request(messages)
            if request is None:
                _count(result, "without a user message")
            else:
                result.requests.append(request)
    return result


def _count(result: ConversationsFile, why: str) -> None:
    result.skipped[why] = result.skipped.get(why, 0) + 1


def _messages(item) -> list[tuple[str, str]]:
    """(role, text) of each message of one line's conversation."""
    if not isinstance(item, dict):
        raise ValueError("expected a JSON object with 'messages' or 'conversations'")
    if "messages" in item:
        return [_openai(m, i) for i, m in enumerate(_list(item, "messages"))]
    if "conversations" in item:
        return [_sharegpt(m, i) for i, m in enumerate(_list(item, "conversations"))]
    raise ValueError(
        "expected a JSON object with 'messages' (OpenAI) or 'conversations' (ShareGPT)"
    )


def _list(item: dict, key: str) -> list:
    value = item[key]
    if not isinstance(value, list):
        raise ValueError(f"'{key}' must be a list of messages")
    return value


def _openai(message, i: int) -> tuple[str, str]:
    if not isinstance(message, dict) or "role" not in message:
        raise ValueError(f"messages[{i}]: expected an object with 'role' and 'content'")
    role = message["role"]
    if role not in OPENAI_ROLES:
        raise ValueError(f"messages[{i}]: role {role!r} is not one of {', '.join(OPENAI_ROLES)}")
    return ("system" if role == "developer" else role), _text(message.get("content"), i)


def _sharegpt(message, i: int) -> tuple[str, str]:
    if not isinstance(message, dict) or "from" not in message:
        raise ValueError(f"conversations[{i}]: expected an object with 'from' and 'value'")
    speaker = str(message["from"]).lower()
    if speaker not in SHAREGPT_ROLES:
        raise ValueError(
            f"conversations[{i}]: 'from' {message['from']!r} is not one of "
            f"{', '.join(sorted(SHAREGPT_ROLES))}"
        )
    return SHAREGPT_ROLES[speaker], _text(message.get("value"), i)


def _text(content, i: int) -> str:
    """A message's text: a string, or OpenAI's list of parts (text parts joined)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""  # an assistant turn with tool calls only: regenerated anyway
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ValueError(f"message {i}: only text content parts are supported")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise ValueError(f"message {i}: content must be a string or a list of text parts")


def _request(messages: list[tuple[str, str]]) -> Request | None:
    """The user's turns (consecutive user messages joined, as one turn) and the first system
    message; None when there is no user message to answer."""
    system = next((text for role, text in messages if role == "system"), None)
    turns: list[str] = []
    previous = None
    for role, text in messages:
        if role == "user":
            if previous == "user":
                turns[-1] += "\n\n" + text
            else:
                turns.append(text)
        if role != "system":
            previous = role
    turns = [t for t in turns if t.strip()]
    if not turns:
        return None
    return Request(tuple(turns), system=system or None)
