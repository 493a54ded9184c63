"""An EAGLE drafter's chain for one greedy request in one C++ call
(``engine/kernels/draft_chain.cpp``).

Drafting one token from Python is some thirty operator calls and the drafting loop's
bookkeeping around the drafter's layer and head. Right after the target's pass, whose weights
leave every cache cold, that glue cost about as much as the products (AMD Zen 4, 8-bit
activations: 0.9-1.0 ms a token in the engine against 0.5 for the same call run twice in a
row). The C++ chain runs every pass of a round (entry, layer on the drafter's paged cache,
head over the draft vocabulary, greedy pick) in one call with the operators the Python path
calls, so the drafts are the same tokens; Python keeps the bookkeeping of the drafter's state
before and after.

It applies to the usual batch-1 case, and the Python loop (``ModelDrafter.draft``) stays the
reference for everything else: one sequence drafting, a greedy request whose logits need no
processing (no penalties, bias, filters or constraints), the fixed window, nothing drafted
before it this round, an entry whose previous features are known (not a prefix hit read again
from zeros), a first pass of at most ``SHORT_QUERY_LIMIT`` entries, no sliding window, the
layer and head on C++ kernels for those row counts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.attention import SHORT_QUERY_LIMIT
from engine.decoders.base import Proposal
from engine.decoders.windows import FixedWindow
from engine.kernels.build import available_isas, load_kernels
from engine.models.decoder_stack import add_layers, projection_parts
from engine.models.quantized_linear import plans_version
from engine.models.weight_formats import StoredWeight
from engine.rejection_sampler import position_row
from engine.sampling import needs_processing

if TYPE_CHECKING:
    from engine.sequence import Sequence

# How an entry's layer input is made (draft_chain.cpp's ``Entry``).
NORMED_PAIR, PROJECTED = 0, 1  # EAGLE-3's [norm(e); norm(f)], EAGLE's fc([e; f])
_FC, _HEAD = 0, 1  # draft_chain.cpp's ``OwnSlot``


class DraftChainInCpp:
    """The C++ chain of one EAGLE drafter, rebuilt when autotune changes a plan. ``entry``:
    NORMED_PAIR (EAGLE-3: ``drafter.embed_norm``, ``hidden_norm``, a normed head) or
    PROJECTED (EAGLE: ``drafter.fc``, the head reads the layer's output as it is)."""

    def __init__(self, drafter, entry: int, fc=None, head=None, head_norm=None):
        self.drafter = drafter
        self.entry = entry
        self.fc, self.head, self.head_norm = fc, head, head_norm
        self._chain = None
        self._version = None
        self._supports: dict[int, bool] = {}

    @staticmethod
    def applies_to(drafter, fc, head) -> bool:
        """Whether the drafter's parts can run in the C++ chain at all."""
        model = drafter.model
        return (
            drafter.stack is not None
            and drafter.device.type == "cpu"
            and model.dtype == torch.float32
            and load_kernels()
            and bool(available_isas())
            and (
                isinstance(model.embed_tokens, StoredWeight)
                or model.embed_tokens.dtype == torch.float32
            )
            and isinstance(model.rope.table, torch.Tensor)
            and model.arch.sliding_window is None
            and projection_parts(head) is not None
            and (fc is None or projection_parts(fc) is not None)
        )

    def _build(self):
        d = self.drafter
        arch = d.model.arch
        chain = torch.classes.specserve.DraftChain(
            arch.num_heads, arch.num_kv_heads, arch.head_dim, float(arch.rms_norm_eps),
            self.entry, d.kv_cache.block_size,
        )  # fmt: skip
        add_layers(chain, [d.layer])
        for slot, projection in ((_FC, self.fc), (_HEAD, self.head)):
            for part in projection_parts(projection) if projection is not None else []:
                chain.add_own_part(slot, *part)
        embed = d.model.embed_tokens
        if isinstance(embed, StoredWeight):
            table = (embed.codes, embed.scales, embed.mins, available_isas()[0])
        else:  # a dense table: its rows are looked up as they are
            table = (embed, torch.empty(0), torch.empty(0), "")
        pair = self.entry == NORMED_PAIR
        chain.set_inputs(
            *table, d.model.rope.table,
            d.draft_vocab, d.embed_norm if pair else None, d.hidden_norm if pair else None,
            self.head_norm, float(getattr(d, "eps", arch.rms_norm_eps)),
        )  # fmt: skip
        return chain

    def _supported(self, rows: int) -> bool:
        if self._version != plans_version():
            self._chain, self._version = self._build(), plans_version()
            self._supports = {}
        if rows not in self._supports:
            self._supports[rows] = self._chain.supports(rows)
        return self._supports[rows]

    def draft(self, seqs: list[Sequence], num_drafts: dict) -> dict[Sequence, Proposal] | None:
        """The round's proposals, or None where the Python loop must draft (module docstring);
        nothing of the drafter's state has changed then."""
        d = self.drafter
        active = [s for s in seqs if num_drafts.get(s, 0) > 0]
        if len(active) != 1 or not isinstance(d.window, FixedWindow):
            return None
        seq = active[0]
        params = seq.sampling_params
        if not params.greedy or needs_processing(
            position_row(params, seq.prompt_token_ids, seq.output_token_ids, [])
        ):
            return None
        log = d._logs.get(seq)
        state = d._state(seq)
        first = state.num_cached
        n = seq.num_tokens - first
        if log is None or first < log.start or first == 0 or not 1 <= n <= SHORT_QUERY_LIMIT:
            return None
        if not self._supported(n):
            return None
        d.begin_round(seq)
        width = d.model.arch.hidden_size
        features = log.before(first, n, width).to(d.device).contiguous()
        ids = torch.tensor(seq.token_ids[first:], dtype=torch.long)
        table = seq.cache_state().block_table
        stops = list(params.stop_token_ids) + ([] if params.ignore_eos else sorted(d.eos_token_ids))
        kv = [t for pair in d.kv_cache.layers for t in pair]
        tokens, tops, entropies, guess = self._chain.draft(
            ids, first, features, list(table), kv, num_drafts[seq], stops
        )
        drafts = tokens.tolist()
        written = n + len(drafts) - 1
        d._written.overwrite(table, first, written)
        state.num_cached = first + written
        log.guess, log.guess_position = guess, state.num_cached - 1
        return {seq: Proposal.drawn(drafts, [], tops.tolist(), entropies.tolist())}
