"""Banned words and phrases: matched on the text, whole words, any casing; removed by rewinding.

An occurrence of a phrase is its characters in any casing (``str.lower`` per character), each
run of whitespace in the phrase matching any run of whitespace in the text, with no word
character (letter, digit, underscore) right before or right after it. So "new york" bans
"New York" and "NEW   YORK." but not "New Yorker" or "renew york".

Whether text is an occurrence is often known only after the next token (is "cat" followed by
"s"?). So the engine keeps such text back from the output stream, and when an occurrence is
complete (a non-word character follows it, or the output ends), it rewinds the sequence to the
token where the occurrence began and bans that token at that position; sampling then picks
from the rest (FSM-with-rollback, as in our design notes). Guarantee: no returned or streamed
text contains an occurrence, except where the server's stop strings cut the text after the
engine judged it ("cat" + a stop string "s..."; docs/decoders.md). Distribution: the
target's, with every banned (position, token) masked, which is what the rewinds leave; not the
target conditioned on the whole text avoiding the phrases (that would need lookahead over all
continuations).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

# Each rewind bans one more (position, token), so rewinding ends; but a model set on a phrase
# may reach it through many tokenizations and casings. Past this many rewinds a sequence ends
# at its last settled token (finish reason "stop") rather than spend its time there.
MAX_REWINDS = 256
# What a byte-level tokenizer's decode gives for an incomplete UTF-8 sequence.
REPLACEMENT = "\ufffd"


def _is_word(char: str) -> bool:
    return char.isalnum() or char == "_"


def _lower(char: str) -> str:
    """One character lowered to one character: "İ".lower() is two ("i" and a combining dot),
    which would shift every index after it."""
    return char.lower()[:1] or char


def normalize_phrase(phrase: str) -> str:
    """Lowered per character as text is (``_Text.of``), whitespace runs as one space,
    trimmed: the form matched against text."""
    return " ".join("".join(map(_lower, phrase)).split())


@dataclass
class _Text:
    """Text lowered per character with whitespace runs collapsed to one space, and for each
    of its characters the index of the character it came from."""

    chars: str
    origin: list[int]

    @classmethod
    def of(cls, text: str) -> _Text:
        chars, origin = [], []
        for i, c in enumerate(text):
            if c.isspace():
                if chars and chars[-1] == " ":
                    continue
                chars.append(" ")
            else:
                chars.append(_lower(c))
            origin.append(i)
        return cls("".join(chars), origin)


@dataclass
class Scan:
    """What a scan found: an occurrence's start (index into the scanned text) and where the
    text must be held back from (its length when nothing is pending)."""

    violation: int | None
    pending: int


def scan(text: str, phrases: Sequence[str], first: int, final: bool) -> Scan:
    """Look for occurrences starting at or after character ``first`` of ``text`` (the character
    before it, if any, is context for the left boundary). ``final``: the text ends here."""
    norm = _Text.of(text)
    chars = norm.chars
    start = next((j for j, i in enumerate(norm.origin) if i >= first), len(chars))
    violation, pending = None, len(text)
    for s in range(start, len(chars)):
        if s > 0 and _is_word(chars[s - 1]):
            continue  # no word boundary before s
        rest = chars[s:]
        for phrase in phrases:
            if rest.startswith(phrase):
                after = s + len(phrase)
                if after < len(chars):
                    if not _is_word(chars[after]):
                        violation = s if violation is None else min(violation, s)
                elif final:
                    violation = s if violation is None else min(violation, s)
                else:
                    pending = min(pending, norm.origin[s])  # its right boundary is to come
            elif phrase.startswith(rest) and not final:
                pending = min(pending, norm.origin[s])  # it may still grow into one
        if violation is not None:
            break
    return Scan(None if violation is None else norm.origin[violation], pending)


@dataclass
class BannedPhrasesState:
    """One sequence's banned phrases: which of its output tokens are settled (``stable``:
    they can no longer be rewound, so the engine reports them), and the tokens banned at
    output positions by earlier rewinds."""

    phrases: list[str]
    decode: Callable[[Sequence[int]], str]
    stable: int = 0
    bans: dict[int, set[int]] = field(default_factory=dict)
    num_rewinds: int = 0

    def mask_(self, logits: torch.Tensor, history: Sequence[int]) -> None:
        banned = self.bans.get(len(history))
        if banned:
            logits[list(banned)] = float("-inf")

    def allows(self, history: Sequence[int]) -> bool:
        """Whether the last token of ``history`` is not banned at its position."""
        return not history or history[-1] not in self.bans.get(len(history) - 1, ())

    def check(self, output: list[int], final: bool) -> int | None:
        """After a token was appended to ``output``: the output index to rewind to when an
        occurrence is complete (None if none), updating ``stable`` otherwise."""
        # One settled token of context before the tokens still in question.
        first_token = max(0, self.stable - 1)
        window = output[first_token:]
        offsets = [len(self.decode(window[:j])) for j in range(len(window) + 1)]
        text = self.decode(window)
        found = scan(text, self.phrases, offsets[self.stable - first_token], final)
        if found.violation is not None:
            # Never before what was settled: the engine has reported those tokens.
            return max(self.stable, first_token + _token_at(offsets, found.violation))
        if not final:
            # A character split across tokens decodes as U+FFFD until its last byte comes:
            # what it becomes (perhaps a phrase's first character) is still to be seen.
            partial = len(text) - len(text.rstrip(REPLACEMENT))
            found.pending = min(found.pending, len(text) - partial)
        if found.pending < len(text):
            self.stable = first_token + _token_at(offsets, found.pending)
        else:
            self.stable = len(output)
        return None

    def rewind(self, output: list[int], position: int) -> None:
        """The output is about to be cut to ``position`` tokens: ban the token there, forget
        the bans past it (they belonged to the text being dropped)."""
        self.bans = {p: b for p, b in self.bans.items() if p <= position}
        self.bans.setdefault(position, set()).add(output[position])
        self.stable = min(self.stable, position)
        self.num_rewinds += 1


def _token_at(offsets: list[int], char: int) -> int:
    """The index of the token whose text contains character ``char`` (offsets[j]: the text
    length of the first j tokens)."""
    for j in range(len(offsets) - 1):
        if offsets[j] <= char < offsets[j + 1]:
            return j
    return len(offsets) - 1
