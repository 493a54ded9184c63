"""Runs the model once over all new tokens of all scheduled sequences.

The runner flattens a step (prefill chunks, decode tokens and, for speculative decoders,
draft tokens to verify) into one batch, plans attention over the block tables, and
returns logits only for the rows that were asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata, SequenceSlice, build_attention_metadata
from engine.cuda_graphs import CudaGraphs, fits_a_graph
from engine.kv_cache import KVCache
from engine.models.llama import LlamaModel, ModelOutput
from engine.token_tree import depths


@dataclass
class ForwardItem:
    """One sequence's share of a step."""

    token_ids: Sequence[int]  # new tokens, at positions num_cached .. num_cached + len - 1
    num_cached: int
    block_table: Sequence[int]
    num_logits: int  # logits for the last ``num_logits`` new tokens (0: a mid-prefill chunk)
    # A token tree to verify instead of a chain (see engine.attention.SequenceSlice): token i
    # follows token tree_parents[i] (-1: the cached tokens) and sits at num_cached + its depth.
    tree_parents: Sequence[int] | None = None
    # Further rows (offsets among this item's new tokens) whose logits are wanted apart from
    # the regular ones: a prompt chunk's rows for prompt logprobs (see ModelRunner.forward).
    extra_logit_rows: Sequence[int] = ()


@dataclass
class FlatBatch:
    """A step's items flattened: token ids and positions over all rows, the attention plan,
    and the rows that want logits."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_rows: torch.Tensor  # the regular rows, then every item's extra rows
    num_regular_rows: int


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, device: torch.device | str):
        self.model = model
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        # The last forward's logits of the items' extra rows, in item order (None: none asked).
        self.extra_logits: torch.Tensor | None = None
        # Decode and verification steps replay CUDA graphs on a GPU whose cache has a scratch
        # slot for their padding (the engine leaves it out under enforce_eager).
        self.graphs = CudaGraphs(model, kv_cache) if CudaGraphs.usable(model, kv_cache) else None
        # Steps of decode and verification rows alone that ran eagerly although graphs are on
        # (no bucket, or the graph limit reached): each one a step slower than it need be.
        self.eager_short_steps = 0

    def run(self, items: Sequence[ForwardItem], **model_options) -> torch.Tensor:
        """Forward all items; returns float32 logits [sum(num_logits), vocab] in item order.

        ``model_options`` go to the model's forward (layer subsets and skips of self drafts).
        """
        return self.forward(items, **model_options).logits

    @torch.inference_mode()
    def forward(self, items: Sequence[ForwardItem], **model_options) -> ModelOutput:
        """As ``run``, returning the model's output: the logits, and with ``hidden_layer`` the
        hidden states after that layer for the same rows."""
        if self.graphs is not None:
            out = self._forward_with_graphs(items, model_options)
            if out is not None:
                return out
            self.eager_short_steps += all(map(fits_a_graph, items))
        return self._forward_eager(items, model_options)

    def _forward_with_graphs(self, items, options: dict) -> ModelOutput | None:
        """The step with its short items replayed in a CUDA graph and the rest (prefill
        chunks, prompt-logprob rows) run eagerly beside it; None when no graph applies.
        Sequences do not see each other's tokens, so one step may run as two passes."""
        short = [i for i, item in enumerate(items) if fits_a_graph(item)]
        if options.get("hidden_layer") is not None and not options.get("all_hidden"):
            if any(item.extra_logit_rows for item in items):
                return None  # the eager pass would return hidden rows of its extra rows too
        replayed = self.graphs.run([items[i] for i in short], options) if short else None
        if replayed is None:
            return None
        graphed = _real_rows_of([items[i] for i in short], *replayed, options)
        if len(short) == len(items):
            self.extra_logits = None
            return graphed
        chosen = set(short)
        rest = [i for i in range(len(items)) if i not in chosen]
        eager = self._forward_eager([items[i] for i in rest], options)  # sets extra_logits
        return _interleave(items, [(short, graphed), (rest, eager)], options)

    def _forward_eager(self, items, model_options: dict) -> ModelOutput:
        batch = self.flatten(items)
        out = self.model(
            batch.input_ids, batch.positions, self.kv_cache.layers, batch.attn,
            logits_indices=batch.logits_rows, **model_options,
        )  # fmt: skip
        self.extra_logits = None
        if out.logits is not None and len(batch.logits_rows) > batch.num_regular_rows:
            # Callers index the regular rows from 0, so the extras come after them and are
            # handed over on the side.
            self.extra_logits = out.logits[batch.num_regular_rows :]
            out.logits = out.logits[: batch.num_regular_rows]
        return out

    def flatten(self, items: Sequence[ForwardItem]) -> FlatBatch:
        """The items as one flattened batch, with its attention plan."""
        input_ids, positions, logits_rows, slices, extra_rows = [], [], [], [], []
        row = 0
        for item in items:
            n = len(item.token_ids)
            input_ids.extend(item.token_ids)
            if item.tree_parents is None:
                positions.extend(range(item.num_cached, item.num_cached + n))
            else:
                positions.extend(item.num_cached + d for d in depths(item.tree_parents))
            logits_rows.extend(range(row + n - item.num_logits, row + n))
            extra_rows.extend(row + i for i in item.extra_logit_rows)
            slices.append(SequenceSlice(item.num_cached, n, item.block_table, item.tree_parents))
            row += n
        arch = self.model.arch
        attn = build_attention_metadata(
            slices, self.kv_cache.block_size, arch.head_dim, self.device, arch.sliding_window,
            invariant=self.model.batch_invariant,
        )  # fmt: skip
        return FlatBatch(
            torch.tensor(input_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            attn,
            torch.tensor(logits_rows + extra_rows, dtype=torch.long, device=self.device),
            len(logits_rows),
        )


def _real_rows_of(
    items: Sequence[ForwardItem], padded: ModelOutput, real_rows: torch.Tensor, options: dict
) -> ModelOutput:
    """A replayed graph's output cut to what ``forward`` returns: the rows that want logits
    (and their hidden states, or every real row's with ``all_hidden``)."""
    logit_rows, row = [], 0
    for item in items:
        n = len(item.token_ids)
        logit_rows.extend(range(row + n - item.num_logits, row + n))
        row += n
    device = padded.hidden_states.device if padded.logits is None else padded.logits.device
    real = real_rows.to(device, non_blocking=True)
    wanted = real[torch.tensor(logit_rows, dtype=torch.long, device=device)]
    logits = None if padded.logits is None else padded.logits.index_select(0, wanted)
    hidden = padded.hidden_states
    if hidden is not None:
        hidden = hidden.index_select(0, real if options.get("all_hidden") else wanted)
    return ModelOutput(logits=logits, hidden_states=hidden)


def _interleave(
    items: Sequence[ForwardItem], parts: list[tuple[list[int], ModelOutput]], options: dict
) -> ModelOutput:
    """Outputs of passes over disjoint subsets of ``items`` (given by index) put back in item
    order: each item owns ``num_logits`` rows (``len(token_ids)`` hidden rows with
    ``all_hidden``)."""
    logits: list = [None] * len(items)
    hidden: list = [None] * len(items)
    for indices, out in parts:
        logit_row = hidden_row = 0
        for i in indices:
            n_logits = items[i].num_logits
            n_hidden = len(items[i].token_ids) if options.get("all_hidden") else n_logits
            if out.logits is not None:
                logits[i] = out.logits[logit_row : logit_row + n_logits]
            if out.hidden_states is not None:
                hidden[i] = out.hidden_states[hidden_row : hidden_row + n_hidden]
            logit_row += n_logits
            hidden_row += n_hidden
    return ModelOutput(
        logits=torch.cat(logits) if logits[0] is not None else None,
        hidden_states=torch.cat(hidden) if hidden[0] is not None else None,
    )
