"""A sequence: one generated continuation of a request, and its place in the KV cache."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from engine.constraints.banned import BannedPhrasesState
from engine.prompt_logprobs import PromptLogprob
from engine.sampling import SampledToken, SamplingParams
from engine.speculative_options import SpeculativeOptions


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class CacheState:
    """What a drafter may know of a sequence's place in the paged KV cache, whatever fields the
    scheduler keeps it in."""

    num_cached: int  # tokens whose target K/V stand in the cache
    block_table: list[int]  # the sequence's blocks (a draft model mirrors the target's ids)
    epoch: int  # changes whenever the sequence's blocks were freed (preemption)
    # Chained content hashes of the leading full, committed blocks (prefix caching on): what
    # a drafter's record of its own entries is checked against (engine/decoders/written_blocks).
    block_hashes: list[int] = field(default_factory=list)

    def committed_blocks(self, first: int = 0, last: int | None = None) -> list[tuple[int, int]]:
        """(block id, content hash) of committed blocks ``first`` .. ``last - 1`` (all by
        default)."""
        end = len(self.block_hashes) if last is None else min(last, len(self.block_hashes))
        return [(self.block_table[i], self.block_hashes[i]) for i in range(first, end)]


@dataclass(eq=False)
class Sequence:
    """Tokens (prompt then output), cache position and per-sequence sampling state.

    ``num_computed_tokens`` counts the tokens whose K/V are in the cache; the tokens after
    it are what the next step must compute (a prefill chunk, or the last sampled token).
    """

    seq_id: str
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[SampledToken] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # Drafting for this sequence: "autoregressive" opts out; None follows the engine's decoder.
    speculative: SpeculativeOptions | None = None
    num_prefix_hit_tokens: int = 0  # prompt tokens reused from the prefix cache at admission
    # The request's prompt logprobs are computed on this sequence (its first one), which is
    # therefore never admitted from the prefix cache; entry j is prompt token j + 1's.
    wants_prompt_logprobs: bool = False
    # The target's hidden states of every position this sequence feeds through the model, at
    # ``hidden_layers`` (LLM.generate(return_hidden_states=...): drafter training reads them
    # from the generation instead of a second, teacher-forced pass): (first position, [rows,
    # len(hidden_layers) * d]) per forward pass, in the order they ran; a recompute's rows
    # replace the earlier ones.
    hidden_chunks: list[tuple[int, torch.Tensor]] | None = None
    hidden_layers: tuple[int, ...] | None = None
    # Banned phrases (engine.constraints.banned): output tokens past ``banned.stable`` are held
    # back from the outputs until they can no longer be rewound.
    banned: BannedPhrasesState | None = None
    num_reported_tokens: int = 0  # output tokens handed out in RequestOutputs so far
    # With SamplingParams.return_provenance: each output token's source (engine.provenance).
    output_sources: list[str] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    # The outputs' form once all are computed: None for the first token, then the above.
    reported_prompt_logprobs: list[PromptLogprob | None] | None = None
    token_ids: list[int] = field(init=False)

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def runs_every_prompt_token(self) -> bool:
        """Whether every prompt position must run a forward pass (no prefix-cache hits):
        their prompt logprobs or hidden states are asked for."""
        return self.wants_prompt_logprobs or self.hidden_chunks is not None

    def hidden_states(self) -> torch.Tensor | None:
        """[num_tokens - 1, d]: the captured hidden state of each position that has been
        fed (all but the last token), or None when not captured."""
        if not self.hidden_chunks:
            return None
        width = self.hidden_chunks[0][1].shape[1]
        # NaN where nothing ran (an aborted sequence's unfed positions)
        out = torch.full((self.num_tokens - 1, width), float("nan"))
        for first, rows in self.hidden_chunks:
            rows = rows[: max(0, len(out) - first)]  # a rewind may have dropped positions
            out[first : first + len(rows)] = rows
        return out

    def prompt_logprob_positions(self, start: int, count: int) -> range:
        """The positions among ``start .. start + count - 1`` whose logits give a prompt
        logprob not yet computed (a recompute after preemption repeats none)."""
        if not self.wants_prompt_logprobs:
            return range(0)
        first = max(start, len(self.prompt_logprobs))
        return range(first, min(start + count, self.num_prompt_tokens - 1))

    @property
    def num_visible_tokens(self) -> int:
        """Output tokens that may be reported: all of them, unless banned phrases hold some
        back (an unfinished sequence's tokens that a rewind could still remove)."""
        if self.banned is None or (self.is_finished and self.finish_reason != "abort"):
            return len(self.output_token_ids)  # a finished sequence's last token was checked
        return self.banned.stable

    def truncate_output(self, length: int) -> None:
        """Drop the output tokens from ``length`` on (a banned phrase's rewind)."""
        del self.token_ids[self.num_prompt_tokens + length :]
        del self.output_token_ids[length:]
        del self.output_logprobs[length:]
        del self.output_sources[length:]

    def cache_state(self) -> CacheState:
        return CacheState(
            self.num_computed_tokens, self.block_table, self.num_preemptions, self.block_hashes
        )

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, sampled: SampledToken) -> None:
        self.token_ids.append(sampled.token_id)
        self.output_token_ids.append(sampled.token_id)
        if self.sampling_params.logprobs is not None:
            self.output_logprobs.append(sampled)
