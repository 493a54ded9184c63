"""The engine: requests in, one scheduled model step at a time, token outputs back."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig

from engine.batch_invariance import make_batch_invariant, unsupported_reason
from engine.config import DecoderConfig, EngineConfig
from engine.constraints import AllConstraints, ConstraintFactory, normalize_phrase
from engine.constraints.banned import MAX_REWINDS
from engine.cuda_graphs import capture_plan
from engine.decoder_registry import decoders_on_drafters, trained_decoders
from engine.decoders import SpeculativeOptions, TargetContext, build_decoder
from engine.decoders.drafter_files import find_shipped_drafter
from engine.decoders.gate import TargetConfidenceGate
from engine.draft_policy import GoodputPolicy
from engine.kernels.build import load_kernels
from engine.kv_cache import BlockManager, KVCache, bytes_per_block
from engine.kv_cache.sizing import kv_cache_blocks
from engine.model_runner import ForwardItem, ModelRunner
from engine.models.llama import LlamaModel
from engine.models.loader import load_model
from engine.models.pull import resolve_model
from engine.outputs import CompletionOutput, RequestOutput
from engine.prompt_logprobs import prompt_logprobs
from engine.provenance import PLAIN
from engine.sampling import SampledToken, Sampler, SamplingParams, make_generator
from engine.scheduler import ScheduledSequence, Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.speculation import Speculator
from engine.step_costs import time_forward_steps
from engine.target_features import TargetFeatures
from engine.thread_governor import ThreadGovernor

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    # Continuations 1..n-1 wait until the first has computed the prompt, so that they are
    # admitted with its blocks from the prefix cache instead of prefilling it again.
    held_back: list[Sequence] = field(default_factory=list)


class Engine:
    """Continuous-batching engine over a paged KV cache.

    ``add_request`` queues token ids with their sampling parameters, ``step`` runs one
    scheduled forward pass and returns the requests that progressed, ``abort`` ends a
    request at any time and frees its blocks, ``abort_sequence`` ends one of its ``n``
    continuations.
    """

    def __init__(
        self,
        config: EngineConfig,
        model: LlamaModel,
        eos_token_ids: Iterable[int],
        threads: ThreadGovernor | None = None,
    ):
        self.config = config
        self.num_rewinds = 0  # banned phrases removed by rewinding a sequence
        # Builds constrained sequences' matchers; create_engine sets it (it needs the model's
        # tokenizer files, which an engine built from bare weights does not have).
        self.constraints: ConstraintFactory | None = None
        self.threads = threads  # None: torch's thread count is left as it is
        self.model = model
        if config.batch_invariant or config.int8_activations:
            make_batch_invariant_or_refuse(model, config)
        arch = model.arch
        self.max_model_len = min(
            config.scheduler.max_model_len or arch.max_position_embeddings,
            arch.max_position_embeddings,
        )
        kv = config.kv_cache
        block_bytes = bytes_per_block(
            arch.num_layers, kv.block_size, arch.num_kv_heads, arch.head_dim, model.dtype
        )
        num_blocks = kv.num_blocks or kv_cache_blocks(config, block_bytes, self.max_model_len)
        if num_blocks * kv.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks * kv.block_size} tokens, less than "
                f"max_model_len {self.max_model_len}: raise kv_cache size or lower max_model_len"
            )
        graphs = torch.device(config.device).type == "cuda" and not config.enforce_eager
        self.kv_cache = KVCache(
            arch.num_layers,
            num_blocks,
            kv.block_size,
            arch.num_kv_heads,
            arch.head_dim,
            model.dtype,
            config.device,
            # One block no sequence gets, for the padding of CUDA graphs' fixed-shape steps.
            scratch_blocks=int(graphs),
        )
        self.block_manager = BlockManager(num_blocks, kv.block_size, kv.enable_prefix_caching)
        sched = config.scheduler
        self.scheduler = Scheduler(
            self.block_manager, sched.max_num_seqs, sched.max_num_batched_tokens
        )
        self.runner = ModelRunner(model, self.kv_cache, config.device)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids)
        self.speculator = self.build_speculator(config.decoder)
        if config.decoder.method != "autoregressive":
            # The goodput policy times the target's steps before its first choice (about 2 s
            # on SmolLM2 here): done now, not inside a request's first drafting step, where it
            # had made a fresh engine's ngram run at 0.58x plain decoding. Decoders loaded
            # only for requests that pick them stay lazy (the server calibrates at start-up).
            self.calibrate_step_costs()
        if self.runner.graphs is not None:
            self._precapture_graphs()
        self.requests: dict[str, Request] = {}
        # Requests with a continuation aborted since the last step: that step reports them.
        self._aborted_since_step: set[str] = set()
        self._last_step_started: float | None = None  # the previous step's, if it ran any

    def _precapture_graphs(self) -> None:
        """The target's CUDA graphs of decode steps and, with drafting decoders, of every
        verification width up to 1 + k (with the hidden states trained drafters read)."""
        started = time.perf_counter()
        plan = capture_plan(self.config.scheduler.max_num_seqs, *self.graph_widths_and_options())
        count = self.runner.graphs.precapture(plan)
        log.info("captured %d CUDA graphs in %.1f s", count, time.perf_counter() - started)

    def graph_widths_and_options(self) -> tuple[int, list[dict]]:
        """The widest query run a decode or verification step of this engine's decoders has
        (1 + k: the goodput policy may pick any k up to the configured one, and a tree of k
        drafts is as wide as a chain), and the model options of its steps."""
        options: list[dict] = [{}]
        spec = self.speculator
        if spec is None:
            return 1, options
        layers = spec.loaded_feature_layers()
        if layers:
            hidden_layer = layers[0] if len(layers) == 1 else layers
            options.append({"hidden_layer": hidden_layer, "all_hidden": True})
        return 1 + self.config.decoder.num_speculative_tokens, options

    def use_speculator(self, speculator: Speculator | None) -> None:
        """Draft with ``speculator`` (one of ``build_speculator``'s; None: plain decoding)
        from the next request on: a bench compares decoders on one loaded target this way.
        Only between requests: a running sequence's drafter state lives in the old one."""
        if self.has_unfinished_requests():
            raise RuntimeError("the speculator changes only while no request is running")
        self.speculator = speculator

    def build_speculator(self, config: DecoderConfig) -> Speculator | None:
        """A speculator for the decoders of ``config`` over this engine's model and KV cache
        (None when none drafts). The engine builds its own from its config; benchmarks and the
        layer-skip tuner build others and swap ``engine.speculator`` while no request runs."""
        target = TargetContext(
            self.model, self.kv_cache, self.config.device, self.eos_token_ids, self.max_model_len
        )
        names = list(config.methods)
        if config.load_shipped_drafters:
            names += [kind for kind in trained_decoders() if find_shipped_drafter(kind, self.model)]
            # ... and those that draft with one of them (hybrid: lookup, else the heads).
            names += [
                name
                for name, kind in decoders_on_drafters(config).items()
                if find_shipped_drafter(kind, self.model)
            ]
        drafting = {
            name: build_decoder(name, config, target)
            for name in dict.fromkeys(names)
            if name != "autoregressive"
        }
        if not drafting:
            return None
        return Speculator(
            drafting,
            config.method,
            config.num_speculative_tokens,
            self.block_manager,
            self.eos_token_ids,
            self.max_model_len,
            TargetConfidenceGate(config.gate.min_target_prob),
            self.kv_cache,
            GoodputPolicy(
                calibrate=self._step_cost_timer(config), max_step_stretch=config.max_step_stretch
            )
            if config.draft_policy == "goodput"
            else None,
            num_target_layers=self.model.arch.num_layers,
            trim_drafts=config.trim_unlikely_drafts,
        )

    def _step_cost_timer(self, config: DecoderConfig):
        """Times the forward pass by step size for the goodput policy, up to the largest step
        drafting can make (each running sequence with k drafts)."""
        sched = self.config.scheduler
        largest = min(sched.max_num_batched_tokens,
                      sched.max_num_seqs * (1 + config.num_speculative_tokens))  # fmt: skip
        return lambda: time_forward_steps(
            self.runner, self.block_manager, largest, max_model_len=self.max_model_len
        )

    def calibrate_step_costs(self) -> None:
        """Measure now what the goodput policy would measure before its first choice (the
        engine process does it at start-up, so no request waits for it)."""
        if self.speculator is not None and self.speculator.policy is not None:
            self.speculator.policy.ensure_calibrated()

    # ---- requests ----------------------------------------------------------------------
    @property
    def loaded_decoders(self) -> list[str]:
        """Decoders a request may pick: always autoregressive, and the configured ones."""
        names = ["autoregressive"]
        if self.speculator is not None:
            names += list(self.speculator.decoders)
        return names

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        speculative: SpeculativeOptions | None = None,
        return_hidden_states: bool | tuple[int, ...] = False,
    ) -> None:
        """Queue a request; raises ValueError for input the engine cannot serve.

        ``return_hidden_states`` captures the target's last-layer hidden state (before the
        final norm) at every position the request feeds through the model, or with a tuple
        of layer indices those layers' outputs side by side, handed back with its finished
        outputs (``CompletionOutput.hidden_states``); such a request decodes
        autoregressively and takes no prefix-cache hits."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_prompt(prompt_token_ids, params)
        if speculative is not None and speculative.method not in self.loaded_decoders:
            raise ValueError(
                f"speculative method {speculative.method!r} is not loaded; "
                f"loaded: {', '.join(self.loaded_decoders)}"
            )
        hidden_layers = self._hidden_layers(return_hidden_states)
        if hidden_layers is not None:
            self.validate_hidden_capture(speculative)
        request = Request(request_id, list(prompt_token_ids), params)
        states = self._constraint_states(params)
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            seq = Sequence(
                seq_id=f"{request_id}-{i}",
                request_id=request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=params if states is None else params.for_sequence(states[i][0]),
                generator=make_generator(seed),
                speculative=speculative,
                wants_prompt_logprobs=i == 0 and params.prompt_logprobs is not None,
                hidden_chunks=None if hidden_layers is None else [],
                hidden_layers=hidden_layers,
                banned=None if states is None else states[i][1],
            )
            request.seqs.append(seq)
        self.scheduler.add(request.seqs[0])
        request.held_back = request.seqs[1:]
        self.requests[request_id] = request

    def _hidden_layers(self, wanted: bool | tuple[int, ...]) -> tuple[int, ...] | None:
        """The layers a request's ``return_hidden_states`` captures (None: none)."""
        if wanted is False or wanted is None:
            return None
        num_layers = self.model.arch.num_layers
        layers = (num_layers - 1,) if wanted is True else tuple(wanted)
        if not layers or any(not 0 <= i < num_layers for i in layers):
            raise ValueError(
                f"hidden states of layers {list(layers)} asked for; the model's layers are "
                f"0 to {num_layers - 1}"
            )
        return layers

    def validate_hidden_capture(self, speculative: SpeculativeOptions | None) -> None:
        """ValueError unless requests with these options decode autoregressively, the path
        on which hidden states are captured (a verification pass also runs the rows of drafts
        that are then rejected)."""
        spec = self.speculator
        method = speculative.method if speculative is not None else None
        if spec is not None and spec.decoders.get(method or spec.default_method) is not None:
            raise ValueError(
                "hidden states are captured on the autoregressive path only: ask for "
                "speculative method 'autoregressive'"
            )

    def _constraint_states(self, params: SamplingParams) -> list[tuple] | None:
        """Per sequence of a constrained request: (the state that masks its logits, its banned
        phrases' state or None); None for an unconstrained request. ValueError if unusable."""
        phrases = sorted(
            {normalize_phrase(w) for w in self.config.banned_words + params.banned_words}
        )
        if params.constraint is None and not phrases:
            return None
        if self.constraints is None:
            raise ValueError("constrained decoding needs the model's tokenizer files")
        states = []
        for _ in range(params.n):
            grammar = (
                None if params.constraint is None else self.constraints.state(params.constraint)
            )
            banned = self.constraints.banned(phrases) if phrases else None
            parts = [s for s in (grammar, banned) if s is not None]
            states.append((parts[0] if len(parts) == 1 else AllConstraints(parts), banned))
        return states

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_token_ids)
        vocab = self.model.arch.vocab_size
        if n == 0:
            raise ValueError("prompt is empty: at least one token is required")
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens but the context length is {self.max_model_len}: "
                "it leaves no room for a generated token"
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                f"context length of {self.max_model_len} tokens"
            )
        params.validate()  # again: fields may have been changed since construction
        params.validate_for_vocab(vocab)

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request wherever it is; returns its final output, or None if unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self._aborted_since_step.discard(request_id)  # this output reports it
        for seq in request.seqs:
            if seq in request.held_back:  # never given to the scheduler
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
            elif not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        return self._output(request, {})

    def abort_sequence(self, request_id: str, index: int) -> bool:
        """End continuation ``index`` of a request with reason "abort" and free its blocks.

        The other continuations carry on untouched (each samples from its own generator). The
        next ``step()`` reports the request, even if nothing else of it ran: the aborted
        continuation appears there with ``finish_reason="abort"`` and no new tokens. If it was
        the last unfinished one, that output is the request's final one and the request is
        then gone. Returns False, changing nothing, if the request is unknown, ``index`` is out
        of range or that continuation has already finished.
        """
        request = self.requests.get(request_id)
        if request is None or not 0 <= index < len(request.seqs):
            return False
        seq = request.seqs[index]
        if seq.is_finished:
            return False
        if seq in request.held_back:  # never given to the scheduler
            request.held_back.remove(seq)
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        else:
            self.scheduler.finish(seq, "abort")
            if request.held_back:
                # It was computing the prompt for the others: the next one takes over, reusing
                # whatever full prompt blocks are already in the prefix cache.
                self.scheduler.add(request.held_back.pop(0))
        self._aborted_since_step.add(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward pass; returns the requests that got new tokens or had a
        continuation aborted since the last step (finished ones are then removed)."""
        step_started = time.perf_counter()
        if self.speculator is not None and self._last_step_started is not None:
            self.speculator.observe_step_interval(step_started - self._last_step_started)
        self._last_step_started = None
        if self.threads is not None:
            self.threads.tick()
        spec = self.speculator
        lookahead = spec.plan(self.scheduler.running) if spec else {}
        scheduled = self.scheduler.schedule(lookahead).scheduled
        # Drafting comes after scheduling: a model drafter writes K/V into the granted slots.
        proposals = spec.propose(scheduled) if spec else {}
        new_tokens = self._run(scheduled, proposals) if scheduled else {}
        progressed = {seq.request_id for seq in new_tokens} | self._aborted_since_step
        self._aborted_since_step = set()
        outputs = [self._output(self.requests[r], new_tokens) for r in sorted(progressed)]
        for out in outputs:
            if out.finished:
                del self.requests[out.request_id]
        if scheduled:
            # From this step's start to the next one's: the loop around the steps (outputs
            # to the detokenizer or the API process) is part of what each step costs.
            self._last_step_started = step_started
        return outputs

    def _run(self, scheduled: list[ScheduledSequence], proposals: dict) -> dict[Sequence, int]:
        """Forward the scheduled tokens, sample (or verify drafts) and append the new tokens;
        returns how many tokens each sequence got."""
        # A sequence whose uncomputed tokens all run now gets logits and new tokens; a
        # prefill chunk that stops short of the end does not.
        completing = [s.seq.num_uncomputed_tokens == s.num_new_tokens for s in scheduled]
        accepted_drafts: dict[Sequence, int] = {}
        spec = self.speculator
        if spec is None or spec.plain_step(scheduled, proposals):
            # No drafts to verify: the plain autoregressive step (it hands the step's hidden
            # states to the decoders that read them, which must see every step's).
            items = [_forward_item(s, c) for s, c in zip(scheduled, completing, strict=True)]
            wanted = _ask_prompt_logits(scheduled, items)
            started = time.perf_counter()
            logits, hidden = self._forward(items, scheduled)
            self._record_prompt_logprobs(wanted)
            rows = [s.seq for s, c in zip(scheduled, completing, strict=True) if c]
            sampled = self.sampler(logits, rows, [seq.generator for seq in rows])
            emitted = [(seq, [token]) for seq, token in zip(rows, sampled, strict=True)]
            sources = {seq: [PLAIN] for seq in rows if seq.sampling_params.return_provenance}
            if hidden is not None:
                _capture_hidden(hidden, scheduled, items)
                if spec is not None and spec.needs_target_hidden(scheduled):
                    spec.hand_out_features(hidden, scheduled, {}, {})
            if spec is not None:  # the step as the policy weighs it: forward and sampling
                spec.observe_forward(items, time.perf_counter() - started, drafted=False)
        else:
            items = spec.forward_items(scheduled, completing, proposals)
            wanted = _ask_prompt_logits(scheduled, items)
            started = time.perf_counter()
            logits, hidden = self._forward(items, scheduled)
            self._record_prompt_logprobs(wanted)
            if hidden is not None:
                _capture_hidden(hidden, scheduled, items)  # sequences that opted out of drafts
            found = spec.verify(logits, scheduled, completing, proposals, hidden)
            emitted, accepted_drafts, sources = found.emitted, found.accepted, found.sources
            # Forward and verification: a step with drafts pays for both.
            spec.observe_forward(items, time.perf_counter() - started, drafted=bool(proposals))
        for s in scheduled:
            # The step's tokens and the drafts that stood are in the cache; slots of rejected
            # or unused drafts are released.
            kept = s.num_new_tokens + accepted_drafts.get(s.seq, 0)
            self.block_manager.mark_computed(s.seq, kept)
            self.block_manager.commit_full_blocks(s.seq)
        return {seq: self._append(seq, tokens, sources.get(seq)) for seq, tokens in emitted}

    def _forward(self, items, scheduled) -> tuple[torch.Tensor, TargetFeatures | None]:
        """The step's logits, and the hidden states of every token row at the layers the
        step's drafting decoders read and its capturing sequences keep, when there are any
        (else None)."""
        spec = self.speculator
        layers = set() if spec is None else set(spec.feature_layers(scheduled))
        for s in scheduled:
            if s.seq.hidden_layers is not None:
                layers.update(s.seq.hidden_layers)
        if not layers:
            return self.runner.run(items), None
        wanted = tuple(sorted(layers))
        out = self.runner.forward(
            items, hidden_layer=wanted[0] if len(wanted) == 1 else wanted, all_hidden=True
        )
        return out.logits, TargetFeatures(out.hidden_states, wanted)

    def _record_prompt_logprobs(self, wanted: list[tuple[Sequence, range]]) -> None:
        """The prompt logprobs of this step's prompt chunks, from the runner's extra rows."""
        row = 0
        for seq, positions in wanted:
            logits = self.runner.extra_logits[row : row + len(positions)]
            row += len(positions)
            next_tokens = seq.prompt_token_ids[positions.start + 1 : positions.stop + 1]
            k = seq.sampling_params.prompt_logprobs
            seq.prompt_logprobs.extend(prompt_logprobs(logits, next_tokens, k))
        self.runner.extra_logits = None  # read once: a [rows, vocab] tensor not kept a step longer

    def _append(
        self, seq: Sequence, tokens: list[SampledToken], sources: list[str] | None = None
    ) -> int:
        """Append tokens up to the first that ends the sequence (or completes a banned phrase,
        which rewinds it); returns how many."""
        count = 0
        constraint = seq.sampling_params.constraint_state
        for i, token in enumerate(tokens):
            following = [*seq.output_token_ids, token.token_id] if constraint else None
            if constraint is not None and not constraint.allows(following):
                # Its row had no allowed token left (a grammar whose every continuation a
                # ban has removed, or one that ended at an EOS that ignore_eos did not end
                # on): the sampled token is arbitrary, so the sequence ends before it.
                log.warning("%s: no token satisfies its constraints; it stops", seq.request_id)
                self.scheduler.finish(seq, "stop")
                break
            seq.append_token(token)
            if sources is not None:
                seq.output_sources.append(sources[i])
            count += 1
            reason = self._finish_reason(seq, token.token_id)
            if seq.banned is not None:
                # A stop token's text is left out of the output (the detokenizer drops it), so
                # the text it ends is checked without it: "cat" then a stop token "s" ends on
                # the word "cat".
                shown = seq.output_token_ids
                if reason == "stop" and self._is_stop_token(seq, token.token_id):
                    shown = shown[:-1]
                rewind_to = seq.banned.check(shown, final=reason is not None)
                if rewind_to is not None:
                    # Token by token, as plain decoding meets them: drafts accepted after the
                    # phrase go with it.
                    seq.banned.rewind(seq.output_token_ids, rewind_to)
                    seq.truncate_output(rewind_to)
                    self.num_rewinds += 1
                    if seq.banned.num_rewinds > MAX_REWINDS:
                        seq.truncate_output(seq.banned.stable)
                        self.scheduler.finish(seq, "stop")
                    else:
                        self.scheduler.recompute(seq)
                    break
            if reason is not None:
                self.scheduler.finish(seq, reason)
                break
        self._release_held_back(self.requests[seq.request_id])
        return count

    def _release_held_back(self, request: Request) -> None:
        """The prompt's full blocks are now in the prefix cache: admit the other n-1."""
        for seq in request.held_back:
            self.scheduler.add(seq)
        request.held_back = []

    def _is_stop_token(self, seq: Sequence, token_id: int) -> bool:
        params = seq.sampling_params
        return token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in self.eos_token_ids
        )

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.sampling_params
        if self._is_stop_token(seq, token_id):
            return "stop"
        if params.max_tokens is not None and len(seq.output_token_ids) >= params.max_tokens:
            return "length"
        if seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, request: Request, new_tokens: dict[Sequence, int]) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=i,
                    all_token_ids=seq.output_token_ids,
                    num_tokens=seq.num_visible_tokens,
                    num_new_tokens=_report(seq),
                    finish_reason=seq.finish_reason,
                    all_logprobs=seq.output_logprobs
                    if seq.sampling_params.logprobs is not None
                    else None,
                    all_sources=seq.output_sources
                    if seq.sampling_params.return_provenance
                    else None,
                    hidden_states=seq.hidden_states() if seq.is_finished else None,
                )
                for i, seq in enumerate(request.seqs)
            ],
            num_cached_prompt_tokens=request.seqs[0].num_prefix_hit_tokens,
            prompt_logprobs=_prompt_logprobs_of(request.seqs[0]),
        )


def _capture_hidden(features: TargetFeatures, scheduled: list[ScheduledSequence], items) -> None:
    """Keep the hidden-state rows of the sequences that capture them (one row per token of
    the flattened batch, in item order)."""
    row = 0
    for s, item in zip(scheduled, items, strict=True):
        n = len(item.token_ids)
        if s.seq.hidden_chunks is not None:
            own = TargetFeatures(features.rows[row : row + n], features.layers)
            # a copy: not the step's buffer, which the next step overwrites
            rows = own.of(s.seq.hidden_layers).to("cpu", torch.float32, copy=True)
            s.seq.hidden_chunks.append((item.num_cached, rows))
        row += n


def _report(seq: Sequence) -> int:
    """How many output tokens this output hands out for the first time."""
    visible = seq.num_visible_tokens
    new = max(0, visible - seq.num_reported_tokens)
    seq.num_reported_tokens = visible
    return new


def _prompt_logprobs_of(seq: Sequence) -> list | None:
    """The request's prompt logprobs once all are computed (None before, or if not asked)."""
    if not seq.wants_prompt_logprobs or len(seq.prompt_logprobs) < seq.num_prompt_tokens - 1:
        return None
    if seq.reported_prompt_logprobs is None:
        # Built once: every later output shares it instead of copying the prompt's each step.
        seq.reported_prompt_logprobs = [None, *seq.prompt_logprobs]
    return seq.reported_prompt_logprobs


def _ask_prompt_logits(scheduled: list[ScheduledSequence], items: list[ForwardItem]):
    """Ask the runner for the logits of prompt positions whose prompt logprobs are wanted;
    returns (sequence, positions) in the order the runner hands the extra rows back."""
    wanted = []
    for s, item in zip(scheduled, items, strict=True):
        start = s.seq.num_computed_tokens
        positions = s.seq.prompt_logprob_positions(start, s.num_new_tokens)
        if positions:
            item.extra_logit_rows = range(positions.start - start, positions.stop - start)
            wanted.append((s.seq, positions))
    return wanted


def _forward_item(s: ScheduledSequence, completes: bool) -> ForwardItem:
    seq, start = s.seq, s.seq.num_computed_tokens
    return ForwardItem(
        token_ids=seq.token_ids[start : start + s.num_new_tokens],
        num_cached=start,
        block_table=seq.block_table,
        num_logits=1 if completes else 0,
    )


def eos_token_ids_of(model_dir, hf_config) -> set[int]:
    """EOS ids from generation_config.json and config.json (either may list several)."""
    ids: set[int] = set()
    try:
        ids |= _as_id_set(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    except OSError:
        pass  # no generation_config.json
    return ids | _as_id_set(getattr(hf_config, "eos_token_id", None))


def _as_id_set(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple)) else {int(value)}


def make_batch_invariant_or_refuse(model: LlamaModel, config: EngineConfig) -> None:
    """``config.batch_invariant`` (or ``int8_activations``, which needs it): every row computed
    as it would be alone, or a clear refusal at start where this configuration cannot
    promise it."""
    reason = unsupported_reason(config.device, config.dtype, load_kernels())
    if reason is not None:
        switch = "int8_activations" if config.int8_activations else "batch_invariant"
        raise ValueError(reason.replace("batch_invariant", switch, 1))
    make_batch_invariant(
        model, config.scheduler.max_num_batched_tokens, int8=config.int8_activations
    )


def create_engine(config: EngineConfig, companion_pids: tuple[int, ...] = ()):
    """Resolve the configured model (pulling the embedded default if needed), load it and
    build the engine; returns (engine, model_dir)."""

    # Before loading: autotune runs with these threads. Companions' CPU time (the API server
    # feeding an engine process) is ours, not a neighbour's.
    threads = ThreadGovernor(config.num_threads, companion_pids)
    model_dir = resolve_model(config.model)
    # The rope table covers the model's full context; max_model_len only caps requests.
    model, hf_config = load_model(model_dir, DTYPES[config.dtype], config.device, None)
    eos = eos_token_ids_of(model_dir, hf_config)
    engine = Engine(config, model, eos, threads)
    engine.constraints = ConstraintFactory.for_model_dir(model_dir, model.arch.vocab_size, eos)
    return engine, model_dir
