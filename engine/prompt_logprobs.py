"""Prompt logprobs (vLLM's ``prompt_logprobs``): how likely the model found each prompt token
given the ones before it, with its rank and the top alternatives.

They come from the raw model distribution (no temperature, penalties or bias: those shape
sampling, not the prompt), computed from the same forward pass that fills the prompt's K/V:
the prefill chunk's rows get logits too. A sequence that asks for them is never served from
the prefix cache, since cached tokens run no forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PromptLogprob:
    """Prompt token i (i >= 1) given tokens 0..i-1."""

    token_id: int
    logprob: float
    rank: int  # 1 for the most likely token
    top_logprobs: list[tuple[int, float]]  # the k most likely tokens, best first


def prompt_logprobs(logits: torch.Tensor, next_tokens: list[int], k: int) -> list[PromptLogprob]:
    """One entry per row of ``logits`` (the rows of positions p), for the prompt token at
    p + 1, given in ``next_tokens``."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(next_tokens, dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, targets[:, None])[:, 0]
    ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    entries = []
    for i, token_id in enumerate(next_tokens):
        top = [] if k == 0 else list(zip(top_ids[i].tolist(), top_values[i].tolist(), strict=True))
        entries.append(PromptLogprob(token_id, float(chosen[i]), int(ranks[i]), top))
    return entries
