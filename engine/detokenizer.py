"""Token ids to streamed text, one ``IncrementalDetokenizer`` per generated choice.

Decoding is incremental and exact: the pieces a choice emits concatenate to what
``tokenizer.decode(generated_ids, skip_special_tokens=...)`` gives for the same ids, cut at
the first stop string. Each step decodes only a short window (the tokens since the last
emission plus the few before them, for context such as leading-space handling) and emits
the difference, like vLLM's ``detokenize_incrementally``; text is held back while it ends
in U+FFFD, a UTF-8 character whose remaining bytes are in tokens not generated yet.

Stop strings are matched on that text across token boundaries. Text that could still
become a stop string is held back until it either completes (the choice stops; the stop
string and everything after it are never emitted) or diverges (the text is released).
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Collection, Sequence
from dataclasses import dataclass

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded in front of the first generated one, so that its text is decoded in
# context (vLLM uses the same number).
_PROMPT_CONTEXT = 5
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback pieces
_SPECIAL_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True, slots=True)
class TextDelta:
    """New text of one ``push``; ``stopped`` once a stop string has ended the choice."""

    text: str
    stopped: bool = False
    stop_string: str | None = None


class IncrementalDetokenizer:
    """Streams the text of one generated choice, with OpenAI/vLLM stop-string semantics.

    ``prompt_token_ids``: the prompt's last few tokens give the first generated token its
    decoding context. ``stop``: stop strings; the earliest match in the text wins (on a tie,
    the shorter one: it completes first). ``stop_token_ids``: ids that may end the choice
    (the tokenizer's EOS is always included). Their text is held until the next ``push``
    shows the choice went on, or until ``finish`` decides; this is what lets
    ``finish(drop_last_token=True)`` leave out a stop token's text without delaying others.
    ``min_tokens``: stop strings are not matched before that many tokens were generated
    (vLLM's semantics: a stop string completed earlier is ordinary text).
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        *,
        stop_token_ids: Collection[int] = (),
        min_tokens: int = 0,
    ):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._skipped_ids = _skipped_special_ids(tokenizer) if skip_special_tokens else frozenset()
        self._stops = tuple(dict.fromkeys(s for s in stop if s))  # "" would match everywhere
        self._longest_stop = max(map(len, self._stops), default=0)
        self._min_tokens = min_tokens
        eos = getattr(tokenizer, "eos_token_id", None)
        self._hold_ids = frozenset(stop_token_ids) | ({eos} if isinstance(eos, int) else set())
        # Decode window: tokens [0, _read) were already turned into text (their decoding is
        # _prefix_text); tokens from _read on are not yet.
        self._window = self._prompt_context(prompt_token_ids)
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        self._pending = ""  # decoded but not emitted: it may be the start of a stop string
        self._held_token: int | None = None
        self._text = ""
        self._token_count = 0
        self._stop_string: str | None = None
        self._finished = False

    @property
    def text(self) -> str:
        """All text emitted so far (pushes and ``finish``)."""
        return self._text

    @property
    def token_count(self) -> int:
        """Generated tokens that belong to the choice: every pushed token, except those
        after the one that completed a stop string. Stop tokens dropped by ``finish`` count
        (they were generated; usage counts them, as vLLM does)."""
        return self._token_count

    @property
    def stopped(self) -> bool:
        """Whether a stop string ended the choice."""
        return self._stop_string is not None

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the choice, if any."""
        return self._stop_string

    def push(self, new_token_ids: Sequence[int]) -> TextDelta:
        """Add generated tokens; return the text that became final.

        Tokens are taken one at a time, so a stop string that completes in the middle of a
        multi-token push (speculative decoding) ends the choice there: later tokens are
        neither emitted nor counted. Once stopped, further pushes return an empty delta with
        ``stopped=True`` (in-flight engine outputs may still arrive before the abort lands).
        Pushing after ``finish`` is a caller bug and raises ``RuntimeError``.
        """
        if self._finished:
            raise RuntimeError("push() after finish()")
        start = len(self._text)
        for token_id in new_token_ids:
            self._release_held_token()  # a token arrived after it: it did not end the choice
            if self._stop_string is not None:
                break
            self._token_count += 1
            if token_id in self._hold_ids:
                self._held_token = token_id
            else:
                self._consume(token_id)
        return TextDelta(self._text[start:], self.stopped, self._stop_string)

    def finish(self, drop_last_token: bool = False) -> str:
        """End the choice; return the text still held back.

        ``drop_last_token=True`` when the engine ended the choice with a stop token or EOS:
        the last token's text is left out. That is only possible for a token still held,
        i.e. one in ``stop_token_ids`` or EOS; any other token's text has already been
        streamed and cannot be taken back. A partial stop string that never completed is
        released, and so is an unfinished UTF-8 character (as U+FFFD, as ``decode`` does).
        Calling it again, or after a stop string, returns "".
        """
        if self._finished:
            return ""
        self._finished = True
        start = len(self._text)
        held, self._held_token = self._held_token, None
        if held is not None and not drop_last_token:
            self._consume(held)
        if self._stop_string is None:
            self._pending += self._decode_step(final=True)
            self._resolve_stops(final=True)
        return self._text[start:]

    def _release_held_token(self) -> None:
        if self._held_token is not None:
            held, self._held_token = self._held_token, None
            self._consume(held)

    def _consume(self, token_id: int) -> None:
        # decode(skip_special_tokens=True) drops special ids before decoding anything else,
        # so leaving them out of the window is exact, and it keeps the window short when a
        # model emits runs of special tokens.
        if token_id in self._skipped_ids:
            return
        self._window.append(token_id)
        piece = self._decode_step(final=False)
        if piece:
            self._pending += piece
            self._resolve_stops(final=False)

    def _decode_step(self, final: bool) -> str:
        """Text of the unread tokens, or "" while it may still change."""
        full = self._decode(self._window)
        if not final and (len(full) <= len(self._prefix_text) or full.endswith(_REPLACEMENT)):
            return ""  # nothing new, or an unfinished UTF-8 character: wait for more bytes
        piece = full[len(self._prefix_text) :]
        # The emitted text ends on a whole character, so the next window can start at the
        # old read offset: the tokens just read become the next step's context.
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        return piece

    def _resolve_stops(self, final: bool) -> None:
        """Emit the pending text that can no longer be part of a stop string."""
        pending = self._pending
        # Before min_tokens a complete stop string is text; a partial one is still held, as
        # the token that reaches min_tokens may complete it.
        active = self._token_count >= self._min_tokens
        match = self._earliest_stop(pending) if active else None
        hold = len(pending) if final else self._partial_stop_start(pending)
        # A partial stop starting before the match could still complete and would then be
        # the earlier match, so the match only wins when nothing starts before it.
        if match is not None and match[0] <= hold:
            self._text += pending[: match[0]]
            self._pending = ""
            self._stop_string = match[1]
            return
        self._text += pending[:hold]
        self._pending = pending[hold:]

    def _earliest_stop(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            i = text.find(stop)
            if i >= 0 and (best is None or (i, len(stop)) < best[:2]):
                best = (i, len(stop), stop)
        return None if best is None else (best[0], best[2])

    def _partial_stop_start(self, text: str) -> int:
        """Start of the longest suffix of ``text`` that is a proper prefix of a stop string
        (``len(text)`` if none)."""
        for j in range(max(0, len(text) - self._longest_stop + 1), len(text)):
            tail = text[j:]
            if any(len(s) > len(tail) and s.startswith(tail) for s in self._stops):
                return j
        return len(text)

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        ids = [int(t) for t in list(prompt_token_ids)[-_PROMPT_CONTEXT:]]
        ids = [t for t in ids if t not in self._skipped_ids]
        # A prompt that ends inside a UTF-8 character must not lend its first bytes to the
        # generated text: decode(generated_ids) would not see them either.
        while ids and self._decode(ids).endswith(_REPLACEMENT):
            ids.pop()
        return ids

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)


def token_text(tokenizer, token_id: int) -> str:
    """The text of one token as OpenAI's logprobs ``token`` field shows it (" Paris").

    Special tokens show their text. A token holding part of a UTF-8 character shows U+FFFD
    for it; ``token_bytes`` has the exact bytes.
    """
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    piece = tokenizer.convert_ids_to_tokens(token_id)
    # SentencePiece decoders strip the leading space of a whole text; one token alone is a
    # whole text, but in the stream its "\u2581" is a space.
    if isinstance(piece, str) and piece.startswith("\u2581") and not text.startswith(" "):
        text = " " + text
    return text


def token_bytes(tokenizer, token_id: int) -> list[int]:
    """The bytes of one token for OpenAI's logprobs ``bytes`` field.

    Byte-level BPE and byte-fallback tokens give their raw bytes, so that a client can join
    the bytes of consecutive tokens into a character split between them; other tokens give
    the UTF-8 encoding of ``token_text``.
    """
    text = token_text(tokenizer, token_id)
    raw = _raw_bytes(tokenizer.convert_ids_to_tokens(token_id))
    if raw is not None and raw.decode("utf-8", errors="replace") == text:
        return list(raw)
    return list(text.encode("utf-8"))


def _raw_bytes(piece) -> bytes | None:
    if not isinstance(piece, str) or not piece:
        return None
    if m := _BYTE_FALLBACK.fullmatch(piece):
        return bytes([int(m.group(1), 16)])
    alphabet = _byte_level_alphabet()
    if all(c in alphabet for c in piece):
        return bytes(alphabet[c] for c in piece)
    return None


_ALPHABET: dict[str, int] = {}


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: printable bytes stand for
    themselves, the others are shifted to U+0100 onwards."""
    if not _ALPHABET:
        printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
        chars = {b: chr(b) for b in printable}
        shifted = (b for b in range(256) if b not in chars)
        chars.update({b: chr(0x100 + n) for n, b in enumerate(shifted)})
        _ALPHABET.update({c: b for b, c in chars.items()})
    return _ALPHABET


def _skipped_special_ids(tokenizer) -> frozenset[int]:
    """Ids that ``decode(..., skip_special_tokens=True)`` leaves out, cached per tokenizer."""
    try:
        return _SPECIAL_IDS[tokenizer]
    except (KeyError, TypeError):
        pass
    candidates = set(getattr(tokenizer, "all_special_ids", ()))
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    candidates.update(i for i, tok in added.items() if getattr(tok, "special", False))
    # Checked rather than trusted: dropping an id that decode would keep would change text.
    ids = frozenset(i for i in candidates if tokenizer.decode([i], skip_special_tokens=True) == "")
    try:
        _SPECIAL_IDS[tokenizer] = ids
    except TypeError:  # not weak-referenceable: recompute per instance
        pass
    return ids
