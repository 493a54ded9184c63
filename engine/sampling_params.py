"""What a request asks of the sampler: ``SamplingParams`` (OpenAI and vLLM semantics, checked
on construction) and the ``SampledToken`` it gets back.

Plain data, no torch: the API process builds and validates these for every request, and only
the engine process (engine/sampling.py) turns them into tensors.
"""

import math
import numbers
from dataclasses import dataclass, field, replace
from typing import Any

from engine.constraints.spec import ConstraintSpec

MAX_LOGPROBS = 20
GREEDY_TEMPERATURE = 1e-5
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


def _require(ok: bool, name: str, rule: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{name} must be {rule}, got {value!r}")


def _listed(values: list) -> Any:
    """One offending value as itself, several as the list of them."""
    return values[0] if len(values) == 1 else values


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A real number, finite: JSON clients can send Infinity and NaN, which no field means."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _is_token_id(value: Any) -> bool:
    return _is_int(value) and value >= 0


def logit_bias_problems(logit_bias: dict, vocab_size: int | None = None) -> list[str]:
    """Everything wrong with a logit_bias map at once (keys that are no token ids, ids beyond
    the vocabulary when its size is given, values out of range, named by their keys): a client
    fixing them one 400 at a time is a poor API."""
    bad_keys, beyond, bad_values = [], [], {}
    for key, value in logit_bias.items():
        token_id = _parse_token_id(key)
        if token_id is None:
            bad_keys.append(key)
        elif vocab_size is not None and token_id >= vocab_size:
            beyond.append(key)
        if not (_is_number(value) and -100 <= value <= 100):
            bad_values[key] = value
    problems = []
    if bad_keys:
        problems.append(f"logit_bias keys must be token ids (ints >= 0), got {_listed(bad_keys)!r}")
    if beyond:
        problems.append(
            f"logit_bias keys must be < vocab size {vocab_size}, got {_listed(beyond)!r}"
        )
    if bad_values:
        problems.append(f"logit_bias values must be numbers in [-100, 100], got {bad_values!r}")
    return problems


def _parse_token_id(key: Any) -> int | None:
    """Token id from a logit_bias key; OpenAI clients send JSON object keys, i.e. strings."""
    if isinstance(key, str):
        try:
            key = int(key)
        except ValueError:
            return None
    return int(key) if _is_token_id(key) else None


@dataclass
class SamplingParams:
    """How to pick tokens for one request, with OpenAI/vLLM semantics and defaults.

    Invalid values raise `ValueError` naming the parameter and its valid range. `top_k=-1` is
    normalised to 0 (disabled); `logit_bias` string keys are converted to int token ids.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    # Logprobs of the prompt's tokens with this many alternatives each (engine.prompt_logprobs).
    prompt_logprobs: int | None = None
    # Output held to a JSON schema, regex, choices or grammar (engine.constraints).
    constraint: ConstraintSpec | None = None
    # Words and phrases the output never contains (engine.constraints.banned: whole words, any
    # casing), on top of the engine config's list.
    banned_words: list[str] = field(default_factory=list)
    # Record where each output token came from (engine.provenance): for playgrounds and
    # debugging, not for the output itself.
    return_provenance: bool = False
    # The engine's per-sequence matcher for ``constraint``: each sequence samples with its own
    # copy of the parameters (``for_sequence``); never set by callers, never pickled across.
    constraint_state: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.stop_token_ids = list(self.stop_token_ids)  # a private copy the caller cannot mutate
        self.banned_words = list(self.banned_words)
        self.validate()
        if self.top_k == -1:
            self.top_k = 0
        self.logit_bias = self._normalised_logit_bias()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid parameter (run again by the engine,
        since fields can be changed after construction)."""
        # Types first, so that a wrong type reads as a ValueError naming the field rather than
        # as a TypeError from a comparison.
        self._check_types()
        self._check_ranges()

    def _check_types(self) -> None:
        for name in ("n", "top_k", "min_tokens"):
            _require(_is_int(getattr(self, name)), name, "an integer", getattr(self, name))
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(value is None or _is_int(value), name, "None or an integer", value)
        for name in _FLOAT_FIELDS:
            _require(_is_number(getattr(self, name)), name, "a finite number", getattr(self, name))

    def _check_ranges(self) -> None:
        max_tokens, logprobs = self.max_tokens, self.logprobs
        # (parameter, valid?, rule); the comparisons are written so that NaN fails them.
        ranges = [
            ("n", self.n >= 1, ">= 1"),
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k >= -1, "-1 or 0 (disabled) or >= 1"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0, "> 0"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("max_tokens", max_tokens is None or max_tokens >= 1, "None or >= 1"),
            ("min_tokens", self.min_tokens >= 0, ">= 0"),
            (
                "min_tokens",
                max_tokens is None or self.min_tokens <= max_tokens,
                f"<= max_tokens ({max_tokens})",
            ),
            (
                "logprobs",
                logprobs is None or 0 <= logprobs <= MAX_LOGPROBS,
                f"None or in [0, {MAX_LOGPROBS}]",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                f"None or in [0, {MAX_LOGPROBS}]",
            ),
            ("stop_token_ids", all(map(_is_token_id, self.stop_token_ids)), "ints >= 0"),
            (
                "banned_words",
                all(isinstance(w, str) and any(map(str.isalnum, w)) for w in self.banned_words),
                "strings with at least one letter or digit",
            ),
        ]
        for name, ok, rule in ranges:
            _require(ok, name, rule, getattr(self, name))

    def _normalised_logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        problems = logit_bias_problems(self.logit_bias)
        if problems:
            raise ValueError("; ".join(problems))
        return {_parse_token_id(key): float(value) for key, value in self.logit_bias.items()}

    def __getstate__(self) -> dict:
        # A sequence's matcher (llguidance) does not pickle, and belongs to that sequence
        # alone: a copy that crosses a process boundary rebuilds its own from ``constraint``.
        return {**self.__dict__, "constraint_state": None}

    def for_sequence(self, constraint_state) -> "SamplingParams":
        """A copy of these parameters carrying one sequence's constraint matcher."""
        copy = replace(self)
        copy.constraint_state = constraint_state
        return copy

    @property
    def greedy(self) -> bool:
        """True when the request wants the argmax token: temperature 0, or so close to it
        that dividing by it would overflow float32 (vLLM uses the same threshold)."""
        return self.temperature < GREEDY_TEMPERATURE

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Raise `ValueError` if a logit_bias key or stop token id is not below `vocab_size`."""
        rule = f"< vocab size {vocab_size}"
        for name, ids in (
            ("logit_bias keys", self.logit_bias or {}),
            ("stop_token_ids", self.stop_token_ids),
        ):
            beyond = [token_id for token_id in ids if token_id >= vocab_size]
            _require(not beyond, name, rule, _listed(beyond))


@dataclass
class SampledToken:
    """A chosen token; logprobs are of the raw model distribution, None when not requested."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
