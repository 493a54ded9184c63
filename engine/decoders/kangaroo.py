"""Kangaroo (Liu et al. 2024): self-speculative decoding with a double early exit.

The draft model is the target's own first ``exit_layer`` layers (the shallow sub-network, the
target's weights as they are) followed by a trained adapter: one attention sublayer of its own
and a norm, read out through the target's LM head cut to the draft vocabulary
(``engine.decoders.drafter_files``). The second exit stops drafting once the drafter's top-1
probability falls below ``exit_threshold`` (Kangaroo's eta): its K/V are already computed for
nothing more than the shallow layers, and a doubtful draft is seldom accepted.

The shallow layers' K/V of a verified token are the target's own (the same weights read the
same tokens), so the draft reads them from the target's cache and writes its tokens' into the
lookahead slots the scheduler granted, which the verification then overwrites (as a self draft
does). Only the adapter keeps a cache of its own (one layer's worth over the target's block
ids). It catches up on the tokens it has not read (a new sequence's prompt, a stretch of steps
that did not draft) from the shallow hidden states the target's own steps captured, not by
running the shallow layers again: a stretch without drafts costs the adapter's products for
its tokens and nothing more (``KangarooDrafter``). The shallow layers run as one C++ stack
where the target's do (``KangarooRunner``). Drafts are drawn from its processed q (the
argmax for greedy requests): verification is the general rejection rule.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.decoders.base import TargetContext
from engine.decoders.drafter_files import build_readout, drafter_projection
from engine.decoders.drafter_loading import load_drafter
from engine.decoders.drafting import ModelDrafter
from engine.decoders.feature_log import SequenceFeatureLogs
from engine.decoders.model_draft import ModelDraftDecoder
from engine.decoders.written_blocks import WrittenBlocks, reads_past_fresh_blocks
from engine.kv_cache import KVCache
from engine.model_runner import ModelRunner
from engine.models.llama import DecoderLayer, LlamaModel, ModelOutput, rms_norm
from engine.models.rope import rotate

if TYPE_CHECKING:
    from engine.config import DecoderConfig
    from engine.sequence import Sequence


class KangarooAdapter(nn.Module):
    """The adapter's weights, and its training-time form: x + o(attention(norm(x))) over the
    hidden states after the target's layer ``exit_layer - 1``, then its own output norm. The
    output projection starts at zero and the output norm at the target's final norm, so the
    adapter starts as a plain early exit."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rms_norm_eps: float,
        exit_layer: int,
    ):
        super().__init__()
        d = hidden_size
        self.shape = {
            "hidden_size": hidden_size,
            "num_heads": num_heads,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "rms_norm_eps": rms_norm_eps,
            "exit_layer": exit_layer,
        }
        self.input_norm = nn.Parameter(torch.ones(d))
        self.qkv = nn.Linear(d, (num_heads + 2 * num_kv_heads) * head_dim, bias=False)
        self.o = nn.Linear(num_heads * head_dim, d, bias=False)
        nn.init.zeros_(self.o.weight)
        self.output_norm = nn.Parameter(torch.ones(d))

    def forward_train(self, hidden: torch.Tensor, rope) -> torch.Tensor:
        """[B, T, d] shallow hidden states (positions 0..T-1 each) -> [B, T, d] normed outputs
        for the readout; causal attention within each sequence."""
        s = self.shape
        batch, width, d = hidden.shape
        x = hidden.reshape(batch * width, d)
        qkv = self.qkv(rms_norm(x, self.input_norm, s["rms_norm_eps"]))
        q_size, kv_size = s["num_heads"] * s["head_dim"], s["num_kv_heads"] * s["head_dim"]
        q = rotate(qkv[:, :q_size].unflatten(1, (-1, s["head_dim"])), rope)
        k = rotate(qkv[:, q_size : q_size + kv_size].unflatten(1, (-1, s["head_dim"])), rope)
        v = qkv[:, q_size + kv_size :].unflatten(1, (-1, s["head_dim"]))

        def heads_first(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(batch, width, -1, s["head_dim"]).transpose(1, 2)

        attended = torch.nn.functional.scaled_dot_product_attention(
            heads_first(q), heads_first(k), heads_first(v), is_causal=True, enable_gqa=True
        )
        out = x + self.o(attended.transpose(1, 2).reshape(batch * width, -1))
        return rms_norm(out, self.output_norm, s["rms_norm_eps"]).reshape(batch, width, d)


class DraftVocabularyHead(nn.Module):
    """Logits over the whole vocabulary from a readout of the draft vocabulary's rows: -inf
    outside it (the drafter can never propose those tokens)."""

    def __init__(self, readout: nn.Module, draft_vocab: torch.Tensor, vocab_size: int):
        super().__init__()
        self.readout = readout
        self.draft_vocab = draft_vocab
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.readout(x).float()
        logits = torch.full(
            (x.shape[0], self.vocab_size), float("-inf"), dtype=torch.float32, device=x.device
        )
        logits[:, self.draft_vocab] = scores
        return logits


class KangarooRunner(ModelRunner):
    """The draft model's forward pass: the target's first layers as a model of their own (so
    they run as one C++ stack where the target's do) over the target's cache, then the
    adapter's attention sublayer over a cache of its own (its K/V for every row it reads:
    ``catch_up`` rows first, then the new tokens), then its output norm and the
    draft-vocabulary head on the rows that want logits."""

    def __init__(self, adapter: KangarooAdapter, draft_vocab, target, quantization: str):
        model = target.model
        arch = model.arch
        self.exit_layer = adapter.shape["exit_layer"]
        if not 1 <= self.exit_layer < arch.num_layers:
            raise ValueError(f"kangaroo exit_layer {self.exit_layer} is not inside the target")
        dtype, device = model.dtype, torch.device(target.device)

        def projection(linear: nn.Linear) -> nn.Module:
            return drafter_projection(linear.weight, None, quantization, model)

        def norm(weight: torch.Tensor) -> torch.Tensor:
            return weight.detach().to(device=device, dtype=dtype)

        shallow = LlamaModel(
            arch, model.rope, model.embed_tokens, list(model.layers)[: self.exit_layer],
            model.final_norm, model.lm_head,
        )  # fmt: skip
        cache = target.kv_cache
        super().__init__(shallow, cache, device)
        self.graphs = None  # its forward is its own: the target's graphs do not apply
        self.adapter_cache = KVCache(
            1, cache.num_blocks, cache.block_size, arch.num_kv_heads, arch.head_dim, dtype,
            device,
        )  # fmt: skip
        # No MLP: the adapter is an attention sublayer (``mlp=False`` below), so the layer
        # has neither its norm nor its weights.
        self.adapter = DecoderLayer(
            arch, norm(adapter.input_norm), projection(adapter.qkv), projection(adapter.o),
            None, None, None,
        )  # fmt: skip
        self.output_norm = norm(adapter.output_norm)
        # Ascending ids, the order ModelDrafter keeps: compact scores index the same columns.
        draft_vocab = draft_vocab.sort().values.to(device)
        self.head = DraftVocabularyHead(
            build_readout(model, draft_vocab, quantization), draft_vocab, arch.vocab_size
        )

    @torch.inference_mode()
    def forward(self, items, compact: bool = False, catch_up=None, **model_options) -> ModelOutput:
        """``compact``: logits over the draft vocabulary's columns only (``ModelDrafter``).
        ``catch_up[i]`` (None or [m, d]): the shallow hidden states of the m positions just
        before item i's tokens, which the adapter has not read yet."""
        batch = self.flatten(items)
        shallow = self.model(
            batch.input_ids, batch.positions, self.kv_cache.layers[: self.exit_layer],
            batch.attn, hidden_layer=self.exit_layer - 1, compute_logits=False,
            all_hidden=True,
        ).hidden_states  # fmt: skip
        if catch_up is not None and any(rows is not None for rows in catch_up):
            shallow, batch = self._after_catch_up(items, shallow, catch_up)
        rope = self.model.rope.lookup(batch.positions)
        hidden = self.adapter(shallow, rope, self.adapter_cache.layers[0], batch.attn, mlp=False)
        rows = hidden.index_select(0, batch.logits_rows)
        eps = self.model.arch.rms_norm_eps
        normed = rms_norm(rows, self.output_norm, eps)
        return ModelOutput(
            logits=self.head.readout(normed).float() if compact else self.head(normed)
        )

    def _after_catch_up(self, items, shallow: torch.Tensor, catch_up):
        """The adapter's rows and batch: each item's catch-up rows, then its own."""
        adapter_items, pieces, row = [], [], 0
        for item, rows in zip(items, catch_up, strict=True):
            n = len(item.token_ids)
            own, row = shallow[row : row + n], row + n
            if rows is None or len(rows) == 0:
                adapter_items.append(item)
                pieces.append(own)
                continue
            m = len(rows)
            # Token ids are not read past the shallow layers: the positions and the
            # attention plan over the adapter's cache are what these rows need.
            earlier = [0] * m + list(item.token_ids)
            adapter_items.append(replace(item, token_ids=earlier, num_cached=item.num_cached - m))
            pieces += [rows.to(device=own.device, dtype=own.dtype), own]
        return torch.cat(pieces), self.flatten(adapter_items)


@dataclass
class _AdapterState:
    read: int  # leading positions whose adapter K/V are valid
    cache_epoch: int  # the sequence's cache epoch when ``read`` was set
    # The first position whose block is not recorded yet (``WrittenBlocks``).
    unrecorded_from: int = 0


class KangarooDrafter(ModelDrafter):
    """``ModelDrafter``'s chains over the shallow layers in the target's cache, and the
    adapter's bookkeeping: how far its own cache has read each sequence, and the captured
    shallow hidden states of the tokens after that (a ``FeatureLog``)."""

    def __init__(self, runner: KangarooRunner, eos_token_ids, window):
        super().__init__(runner, eos_token_ids, window, shares_target_cache=True)
        self._adapter: weakref.WeakKeyDictionary[Sequence, _AdapterState] = (
            weakref.WeakKeyDictionary()
        )
        self._logs = SequenceFeatureLogs(_as_captured)
        self._written = WrittenBlocks(runner.adapter_cache.block_size)

    def has_features(self, seq: Sequence) -> bool:
        return seq in self._logs

    def observe(self, seq: Sequence, first_position: int, features: torch.Tensor) -> None:
        # The adapter has read the positions before this for good; after a preemption none
        # (a read position of the old epoch would drop the recomputed prompt's rows).
        cache = seq.cache_state()
        self._logs.observe(seq, first_position, features, self._valid_read(seq, cache))
        adapter, state = self._adapter.get(seq), self._states.get(seq)
        if adapter is not None and state is not None and adapter.cache_epoch == cache.epoch:
            # Entries up to the last round's decode token stand (the accepted drafts' are
            # recorded once the next round starts past them).
            written_to = min(adapter.read, state.start + 1, cache.num_cached)
            adapter.unrecorded_from = self._written.record(
                cache, adapter.unrecorded_from, written_to
            )

    def _valid_read(self, seq: Sequence, cache=None) -> int:
        """Leading positions of ``seq`` whose adapter K/V are valid now (read-only);
        ``cache``: its ``cache_state()`` if the caller has it."""
        cache = seq.cache_state() if cache is None else cache
        adapter = self._adapter.get(seq)
        if adapter is None or adapter.cache_epoch != cache.epoch:
            read = 0  # new, or preempted since (its blocks were freed): nothing of it is read
        else:
            read = min(adapter.read, cache.num_cached)
        log = self._logs.get(seq)
        if log is not None and read < log.start:
            # Below the first captured position (a prefix-cache hit: the target computed
            # nothing there) no features exist: the blocks whose entries the adapter computed
            # for the same content are reused, the rest read again from zeros
            # (engine/decoders/written_blocks.py): the drafts lose accuracy, never exactness.
            trusted = self._written.trusted_prefix(cache)
            read = max(read, min(trusted, log.start, cache.num_cached))
        return read

    def tokens_behind(self, seq: Sequence) -> int:
        """The adapter's backlog (the shallow layers, in the target's cache, have none): what
        the policy must not price as drafting (``Speculator._proposals_of``)."""
        return max(0, seq.num_tokens - self._valid_read(seq))

    def begin_round(self, seq: Sequence) -> None:
        super().begin_round(seq)
        read, epoch = self._valid_read(seq), seq.cache_state().epoch
        previous = self._adapter.get(seq)
        same_epoch = previous is not None and previous.cache_epoch == epoch
        unrecorded_from = previous.unrecorded_from if same_epoch else 0
        self._adapter[seq] = _AdapterState(read, epoch, unrecorded_from)

    def forward(self, seqs, chains, num_logits, compact: bool = False) -> torch.Tensor:
        width = self.runner.model.arch.hidden_size
        self._read_fresh_entries(seqs)
        catch_up = []
        for s in seqs:
            read, start = self._adapter[s].read, self._states[s].num_cached
            log = self._logs.get(s)
            if read >= start:
                catch_up.append(None)
            elif log is None:  # never captured (cannot happen once planned): zeros
                catch_up.append(torch.zeros(start - read, width))
            else:
                catch_up.append(log.at(read, start - read, width))
        items = self.read_items(seqs, chains, num_logits)
        for s, item in zip(seqs, items, strict=True):
            adapter = self._adapter[s]
            # The adapter writes its catch-up rows, then the items' own.
            end = item.num_cached + len(item.token_ids)
            self._written.overwrite(s.cache_state().block_table, adapter.read, end - adapter.read)
            adapter.read = self._states[s].num_cached
        options = {**self.model_options, "compact": compact, "catch_up": catch_up}
        return self.runner.run(items, **options)

    def _read_fresh_entries(self, seqs) -> None:
        """As EAGLE's (``EagleDrafter._read_fresh_entries``): an adapter about to re-read a
        prefix hit from zeros skips the blocks another sequence of this pass writes from the
        target's shallow states."""
        plans = []
        for s in seqs:
            read, log = self._adapter[s].read, self._logs.get(s)
            hit_end = 0 if log is None else log.start  # entry p reads shallow state p
            plans.append((s.cache_state().block_table, read, hit_end, s.num_tokens, hit_end))
        starts = reads_past_fresh_blocks(plans, self.runner.adapter_cache.block_size)
        for s, start in zip(seqs, starts, strict=True):
            self._adapter[s].read = start

    def on_verified(self, seq: Sequence, proposal, num_accepted: int) -> None:
        """The adapter's entries of the decode token and the accepted drafts stand (it read
        all drafts but the last)."""
        super().on_verified(seq, proposal, num_accepted)
        adapter, state = self._adapter.get(seq), self._states.get(seq)
        if adapter is not None and state is not None:
            adapter.read = min(adapter.read, state.start + 1 + num_accepted)


def _as_captured(features: torch.Tensor) -> torch.Tensor:
    """The adapter reads the shallow hidden states as the target's step left them."""
    return features


class KangarooDecoder(ModelDraftDecoder):
    # The adapter catches up on the shallow exit's hidden states of the target's steps.
    reads_target_hidden = True

    def __init__(self, drafter: KangarooDrafter):
        super().__init__("kangaroo", drafter)

    def feature_layers(self, num_layers: int) -> tuple[int, ...]:
        return (self.drafter.runner.exit_layer - 1,)

    def plan(self, seqs: list[Sequence], max_drafts: dict[Sequence, int]) -> dict[Sequence, int]:
        return {s: k for s, k in max_drafts.items() if k > 0 and self.drafter.has_features(s)}

    def observe_target_features(self, seq, first_position: int, features) -> None:
        self.drafter.observe(seq, first_position, features)


class ConfidenceExit:
    """Kangaroo's second exit: draft on while the drafter's top-1 probability is at least
    ``threshold``."""

    name = "confidence"

    def __init__(self, threshold: float):
        self.threshold = threshold

    def keep_drafting(self, confidence: float, entropy: float) -> bool:
        return confidence >= self.threshold

    def on_verified(self, proposal, num_accepted: int) -> None:
        pass


def build_kangaroo_decoder(config: DecoderConfig, target: TargetContext) -> KangarooDecoder:
    spec = config.kangaroo
    drafter = load_drafter(spec.drafter, "kangaroo", KangarooAdapter, target.model)
    runner = KangarooRunner(drafter.network, drafter.draft_vocab, target, spec.quantization)
    window = ConfidenceExit(spec.exit_threshold)
    model_drafter = KangarooDrafter(runner, target.eos_token_ids, window)
    # The head reads out the draft vocabulary alone: unprocessed steps draft over its columns.
    model_drafter.set_draft_vocabulary(runner.head.draft_vocab, runner.head.vocab_size)
    return KangarooDecoder(model_drafter)
