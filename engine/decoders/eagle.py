"""EAGLE (Li et al. 2024): a one-layer drafter that works on the target's features.

The drafter's entry at position p reads the token there and the target's final-normed
last-layer feature one position earlier, ``x_p = fc([embed(token_p); f_{p-1}])``, runs one
Llama decoder layer of its own (attention over its own K/V of the earlier entries), and its
output g_p predicts f_p: read out through the target's LM head cut to the draft vocabulary
(``engine.decoders.drafter_files``), it guesses token p + 1. Drafting goes on from guesses: the
next entry reads the draft token and g_p in place of the target's feature, as at inference in
the paper; ``specserve train eagle`` trains on exactly those inputs (EAGLE-3's training-time
test), so the drafter has seen its own guesses at every depth it drafts.

**Its K/V** live in a one-layer cache of the drafter's own over the target's block ids (as a
separate draft model's do), so the target's allocation, rollback, prefix caching and freeing
cover them; on a prefix-cache hit only the blocks it recorded as computed for that content are
reused (``WrittenBlocks``). Entries computed from guesses are replaced once the
target's features for those positions are known: after a verification only the decode token's
entry stands, and the next round first re-reads the accepted tokens with the target's
features. A position whose previous feature was never seen (the first token, or the tokens of
a prefix-cache hit that the drafter has no entries for) reads a zero feature, as the
drafter was trained at position 0.

Drafts are drawn from the drafter's processed distribution q (``ModelDrafter``: greedy requests
take its argmax), so verification is the general rejection rule: lossless for every sampling
parameter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.attention import SequenceSlice, build_attention_metadata
from engine.decoders.base import Proposal
from engine.decoders.draft_chain import PROJECTED, DraftChainInCpp
from engine.decoders.drafter_files import build_readout, drafter_projection
from engine.decoders.drafter_loading import load_drafter
from engine.decoders.drafting import ModelDrafter
from engine.decoders.eagle_tree import draft_tree
from engine.decoders.feature_log import SequenceFeatureLogs
from engine.decoders.model_draft import ModelDraftDecoder
from engine.decoders.windows import build_window
from engine.decoders.written_blocks import WrittenBlocks, reads_past_fresh_blocks
from engine.kv_cache import KVCache
from engine.models.decoder_stack import DecoderStack
from engine.models.llama import DecoderLayer, ModelArchitecture, rms_norm_rows

if TYPE_CHECKING:
    from engine.config import DecoderConfig
    from engine.decoders.base import TargetContext
    from engine.sequence import Sequence


def trainable_layer(network: nn.Module, input_norm: torch.Tensor | None) -> DecoderLayer:
    """``DecoderLayer`` over an EAGLE network's own parameters (``qkv``, ``o``, the norms,
    ``gate_up``, ``down``; its ``shape`` names the geometry), in PyTorch ops: autograd flows."""
    s = network.shape
    arch = ModelArchitecture.of_layer(
        s["hidden_size"], s["num_heads"], s["num_kv_heads"], s["head_dim"],
        s["intermediate_size"], s["rms_norm_eps"],
    )  # fmt: skip
    return DecoderLayer(arch, input_norm, network.qkv, network.o, network.post_attention_norm,
                        network.gate_up, network.down, fused=False)  # fmt: skip


class EagleNetwork(nn.Module):
    """The drafter's weights: ``fc`` over [token embedding; feature], then one decoder layer
    (``DecoderLayer``: the engine drafts with it on the paged cache, training runs its
    ``attention_inputs`` and ``finish`` with autograd). Attention heads and head size are the
    target's: the layer uses the target's rope. ``input_norm=False``: no norm before the
    layer's attention (EAGLE-1's layout, whose first layer has none)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        intermediate_size: int,
        rms_norm_eps: float,
        input_norm: bool = True,
    ):
        super().__init__()
        d = hidden_size
        self.shape = {
            "hidden_size": hidden_size,
            "num_heads": num_heads,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "intermediate_size": intermediate_size,
            "rms_norm_eps": rms_norm_eps,
        }
        if not input_norm:  # (kept out of the shape otherwise: older drafters' files lack it)
            self.shape["input_norm"] = False
        self.fc = nn.Linear(2 * d, d)
        self.input_norm = nn.Parameter(torch.ones(d)) if input_norm else None
        self.qkv = nn.Linear(d, (num_heads + 2 * num_kv_heads) * head_dim, bias=False)
        self.o = nn.Linear(num_heads * head_dim, d, bias=False)
        self.post_attention_norm = nn.Parameter(torch.ones(d))
        self.gate_up = nn.Linear(d, 2 * intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, d, bias=False)

    def layer(self) -> DecoderLayer:
        """The layer over this network's own parameters (PyTorch ops: autograd flows)."""
        return trainable_layer(self, self.input_norm)

    def inputs(self, embeddings: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """x = fc([embedding of the token; feature of the position before])."""
        return self.fc(torch.cat([embeddings, features], dim=-1))

    def entry(self, embeddings: torch.Tensor, features: torch.Tensor):
        """(the attention's input, the residual): both ``inputs`` here (EAGLE-3's differ)."""
        x = self.inputs(embeddings, features)
        return x, x

    def attention_inputs(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, ...]:
        """x [N, d] -> rotated q [N, H, D], rotated k and v [N, KV, D]."""
        return self.layer().attention_inputs(x, rope)

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer's rest: output projection and residual, then the SwiGLU MLP."""
        return self.layer().finish(x, attended)


class EagleDrafter(ModelDrafter):
    """Chains from the EAGLE layer, through ``ModelDrafter``'s drafting loop (sampling, q,
    windows); this class supplies the forward pass and the feature bookkeeping."""

    def __init__(self, network: EagleNetwork, draft_vocab: torch.Tensor, target: TargetContext,
                 window, quantization: str = "int8"):  # fmt: skip
        super().__init__(None, target.eos_token_ids, window, shares_target_cache=False)
        self.model = target.model
        self.attach(network, draft_vocab, target)
        arch, dtype = self.model.arch, self.model.dtype

        def projection(linear: nn.Linear) -> nn.Module:
            return drafter_projection(linear.weight, linear.bias, quantization, self.model)

        def norm(weight: torch.Tensor) -> torch.Tensor:
            return weight.detach().to(device=self.device, dtype=dtype)

        self.fc = projection(network.fc)
        self.layer = DecoderLayer(
            arch,
            None if network.input_norm is None else norm(network.input_norm),
            projection(network.qkv),
            projection(network.o),
            norm(network.post_attention_norm),
            projection(network.gate_up),
            projection(network.down),
        )
        # The layer in one C++ call where the target's stack runs (int8 projections in the
        # kernels' layout): driving it from Python cost about as much as its products.
        self.stack = DecoderStack([self.layer]) if DecoderStack.usable([self.layer]) else None
        # Rows in the same order as the draft vocabulary.
        self.readout = build_readout(self.model, self.draft_vocab, quantization)
        self.chain = (
            DraftChainInCpp(self, PROJECTED, fc=self.fc, head=self.readout)
            if DraftChainInCpp.applies_to(self, self.fc, self.readout) else None
        )  # fmt: skip

    def draft(self, seqs, num_drafts, prefixes=None) -> dict:
        """A batch-1 greedy chain in one C++ call where it applies (``draft_chain``), else
        ``ModelDrafter``'s loop: the same drafts either way."""
        if self.chain is not None and not prefixes:
            proposals = self.chain.draft(seqs, num_drafts)
            if proposals is not None:
                return proposals
        return super().draft(seqs, num_drafts, prefixes)

    def attach(self, network: nn.Module, draft_vocab: torch.Tensor, target: TargetContext):
        """What every EAGLE drafter keeps of the target: its device, the draft vocabulary, a
        one-layer cache over its blocks, and a feature log per sequence."""
        self.device = torch.device(target.device)
        arch = self.model.arch
        shape = network.shape
        if (shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]) != (
            arch.num_heads, arch.num_kv_heads, arch.head_dim
        ):  # fmt: skip
            raise ValueError(f"eagle drafter's attention {shape} does not match the target's")
        self.set_draft_vocabulary(draft_vocab.to(self.device), arch.vocab_size)
        cache = target.kv_cache
        self.kv_cache = KVCache(
            1, cache.num_blocks, cache.block_size, arch.num_kv_heads, arch.head_dim,
            self.model.dtype, self.device,
        )  # fmt: skip
        self._logs = SequenceFeatureLogs(self._final_norm)
        self._written = WrittenBlocks(cache.block_size)

    def has_features(self, seq: Sequence) -> bool:
        return seq in self._logs

    def observe(self, seq: Sequence, first_position: int, features: torch.Tensor) -> None:
        state = self._states.get(seq)
        # Entries from num_cached on will be (re)computed and read features from one before.
        self._logs.observe(seq, first_position, features, state and state.num_cached - 1)
        cache = seq.cache_state()
        if state is not None and state.cache_epoch == cache.epoch:
            # Entries up to the last round's decode token stand (the drafts' after it read
            # guesses until verification has them re-read).
            written_to = min(state.num_cached, state.start + 1, cache.num_cached)
            state.unrecorded_from = self._written.record(cache, state.unrecorded_from, written_to)

    def _final_norm(self, features: torch.Tensor) -> torch.Tensor:
        return rms_norm_rows(features, self.model.final_norm, self.model.arch.rms_norm_eps)

    def _state(self, seq: Sequence):
        state = super()._state(seq)
        log = self._logs.get(seq)
        if log is not None and state.num_cached < log.start:
            # A prefix-cache hit: the target computed nothing below log.start, so there are
            # no features there. The blocks whose entries this drafter computed for the same
            # content are reused; the rest are read again from zero features
            # (engine/decoders/written_blocks.py).
            trusted = min(self._written.trusted_prefix(seq.cache_state()), log.start)
            state.num_cached = max(state.num_cached, trusted)
        return state

    @torch.inference_mode()
    def forward(self, seqs, chains, num_logits, compact: bool = False) -> torch.Tensor:
        """The drafter over each sequence's entries from its first uncached one; returns
        logits over the whole vocabulary (-inf outside the draft vocabulary), or with
        ``compact`` over the draft vocabulary's columns, for the last ``num_logits[seq]``
        entries of each, sequence after sequence."""
        width = self.model.arch.hidden_size
        self._read_fresh_entries(seqs)
        ids, positions, features, slices, rows = [], [], [], [], []
        row = 0
        for s in seqs:
            state, log = self._states[s], self._logs[s]
            tokens = (s.token_ids + chains[s])[state.num_cached :]
            n = len(tokens)
            ids += tokens
            positions += range(state.num_cached, state.num_cached + n)
            features.append(log.before(state.num_cached, n, width))
            block_table = s.cache_state().block_table
            slices.append(SequenceSlice(state.num_cached, n, block_table))
            self._written.overwrite(block_table, state.num_cached, n)
            rows += range(row + n - num_logits[s], row + n)
            row += n
        arch = self.model.arch
        attn = build_attention_metadata(
            slices, self.kv_cache.block_size, arch.head_dim, self.device, arch.sliding_window
        )
        positions_t = torch.tensor(positions, device=self.device)
        embeddings = self.model.embed(torch.tensor(ids, device=self.device))
        features = features[0] if len(features) == 1 else torch.cat(features)
        rope = self.model.rope.lookup(positions_t)
        hidden = self.run_layer(embeddings, features.to(self.device), rope, attn)
        row = 0
        for s, piece in zip(seqs, slices, strict=True):
            state, log = self._states[s], self._logs[s]
            state.num_cached += piece.num_new
            log.guess = hidden[row + piece.num_new - 1].clone()
            log.guess_position = state.num_cached - 1
            row += piece.num_new
        wanted = hidden[torch.tensor(rows, device=self.device)]
        return self.readout(wanted).float() if compact else self.read_out(wanted)

    def _read_fresh_entries(self, seqs) -> None:
        """Sequences about to re-read a prefix hit from zero features (``_state``) skip the
        blocks another sequence of this pass writes from the target's features: the
        siblings of an ``n > 1`` request, or requests sharing a system prompt, that first
        draft together (``reads_past_fresh_blocks``)."""
        plans = []
        for s in seqs:
            state, log = self._states[s], self._logs[s]
            # Entry p reads feature p - 1: known from log.start on (entry 0 reads zeros).
            features_from = log.start + 1 if log.start else 0
            end = min(s.num_tokens, log.end + 1)
            table = s.cache_state().block_table
            plans.append((table, state.num_cached, features_from, end, log.start))
        starts = reads_past_fresh_blocks(plans, self.kv_cache.block_size)
        for s, start in zip(seqs, starts, strict=True):
            self._states[s].num_cached = start

    def entry(self, embeddings: torch.Tensor, features: torch.Tensor):
        """(the attention's input, the residual) of entries reading these tokens' embeddings
        and the features before them: both ``fc([embedding; feature])`` here."""
        x = self.fc(torch.cat([embeddings, features], dim=-1))
        return x, x

    def run_layer(self, embeddings, features, rope, attn) -> torch.Tensor:
        """The layer over new entries on the paged cache; returns their outputs."""
        x, _ = self.entry(embeddings, features)
        if self.stack is not None:
            no_skips = frozenset()
            ran, _ = self.stack.run(x, rope, self.kv_cache.layers, attn, None, None, no_skips,
                                    no_skips)  # fmt: skip
            if ran:
                return x
        return self.layer(x, rope, self.kv_cache.layers[0], attn)

    def read_out(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary (-inf outside the draft vocabulary) of drafter
        outputs ``hidden`` [N, d]."""
        scores = self.readout(hidden).float()
        logits = torch.full(
            (len(hidden), self.model.arch.vocab_size), float("-inf"), dtype=torch.float32,
            device=self.device,
        )  # fmt: skip
        logits[:, self.draft_vocab] = scores
        return logits

    def write_guesses(self, seq: Sequence, first: int, count: int) -> None:
        """Entries of guesses go to positions ``first`` .. ``first + count - 1`` (a draft
        tree's, ``engine.decoders.eagle_tree``): their blocks no longer hold what was recorded."""
        self._written.overwrite(seq.cache_state().block_table, first, count)

    def root_guess(self, seq: Sequence) -> torch.Tensor:
        """The drafter's output at the sequence's newest entry (after ``forward``)."""
        return self._logs[seq].guess

    def on_verified(self, seq: Sequence, proposal: Proposal, num_accepted: int) -> None:
        """Only the decode token's entry read the target's own feature; the accepted drafts'
        entries read guesses, and are recomputed once their features are in. Windows cut
        chains only: a tree's verification tells them nothing."""
        if proposal.parents is None:
            self.window.on_verified(proposal, num_accepted)
        state = self._states.get(seq)
        if state is not None:
            state.num_cached = min(state.num_cached, state.start + 1)


class EagleDecoder(ModelDraftDecoder):
    """Chains, or with ``tree_top_k`` EAGLE-2's dynamic trees (``engine.decoders.eagle_tree``)."""

    reads_target_hidden = True

    def __init__(self, drafter: EagleDrafter, tree_top_k: int = 0, tree_depth: int = 4,
                 name: str = "eagle"):  # fmt: skip
        super().__init__(name, drafter)
        self.tree_top_k = tree_top_k
        self.tree_depth = tree_depth

    def propose(self, seqs, num_drafts) -> dict:
        if not self.tree_top_k:
            return self.drafter.draft(seqs, num_drafts)
        return draft_tree(self.drafter, seqs, num_drafts, self.tree_top_k, self.tree_depth)

    def plan(self, seqs, max_drafts) -> dict:
        return {s: k for s, k in max_drafts.items() if k > 0 and self.drafter.has_features(s)}

    def observe_target_features(self, seq, first_position: int, features) -> None:
        self.drafter.observe(seq, first_position, features)


def build_eagle_decoder(config: DecoderConfig, target: TargetContext) -> EagleDecoder:
    drafter = load_drafter(config.eagle.drafter, "eagle", EagleNetwork, target.model)
    window = build_window(config.window)
    options = config.eagle
    return EagleDecoder(
        EagleDrafter(drafter.network, drafter.draft_vocab, target, window, options.quantization),
        options.tree_top_k,
        options.tree_depth,
    )
