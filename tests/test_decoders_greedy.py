"""Greedy requests emit exactly what autoregressive decoding emits, with every decoder, window
policy and the gate: alone, in one batch that mixes decoders, under preemption, and when other
requests are aborted mid-draft; and no KV block outlives its request. Then the window policies'
and the gate's own rules, exactly.
"""

from __future__ import annotations

import dataclasses

import pytest

from engine import LLM, SamplingParams
from engine.config import WindowConfig
from engine.decoders import Proposal, SpeculativeOptions
from engine.decoders.gate import TargetConfidenceGate
from engine.decoders.windows import AdaptiveDraftExit, EntropyWindow, FixedWindow, build_window
from engine.sequence import Sequence
from tests.tiny_models import save_tiny_model

pytestmark = pytest.mark.usefixtures("single_torch_thread")

# Repetitive prompts, so that prompt lookup finds drafts, and one without repeats.
PROMPTS = [
    [5, 6, 7, 8, 9] * 6,
    [11, 12, 13] * 9 + [14],
    [20 + i % 7 for i in range(40)],
    [3] * 12,
    [(37 * i) % 301 + 17 for i in range(23)],
]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

# One engine per variant loads several drafting decoders (extra_methods); they share its draft
# model, window policy and gate, and each request picks its decoder. The tiny random model is
# nearly flat (top-1 probability ~0.03-0.08, entropy ~4.9-5.2 nats), so the window thresholds
# below sit inside that range: windows both stop early and draft on. "separate" is the tiny
# model plus noise (its own KV cache); "other-shape" a smaller random model (another cache
# geometry). tau2 above every entropy keeps the hierarchy's level 2 drafting to k.
VARIANTS = {
    "self-int8": {
        "methods": ["ngram", "draft", "layerskip", "hierarchical"],
        "draft": {"model": "self", "quantization": "int8"},
        "layerskip": {"skip_attention": [1], "skip_mlp": [0, 2]},
        "hierarchical": {"level1": "ngram", "tau2": 6.0},
    },
    "self-bf16-adaptive": {
        "methods": ["draft", "layerskip", "hierarchical"],
        "draft": {"model": "self", "quantization": "bfloat16"},
        "layerskip": {"exit_layer": 1},
        "hierarchical": {"level1": "draft_truncated", "level1_num_layers": 1, "tau2": 6.0},
        "window": {"policy": "adaptive_exit", "gamma": 0.05},
    },
    "self-truncated-entropy-gated": {
        "methods": ["draft", "hierarchical", "ngram"],
        "draft": {"model": "self", "quantization": "none", "num_layers": 1},
        "hierarchical": {"level1": "ngram", "tau2": 6.0},
        "window": {"policy": "entropy", "tau": 5.1},
        "gate": {"min_target_prob": 0.05},
    },
    "separate-entropy": {
        "methods": ["draft", "hierarchical", "layerskip"],
        "draft": {"model": "separate", "quantization": "none"},
        "layerskip": {"exit_layer": 0},
        "hierarchical": {"level1": "draft_truncated", "level1_num_layers": 2, "tau2": 6.0},
        "window": {"policy": "entropy", "tau": 5.1},
    },
    "other-shape-int8-gated": {
        "methods": ["draft", "hierarchical"],
        "draft": {"model": "other-shape", "quantization": "int8"},
        "hierarchical": {"level1": "ngram", "tau2": 6.0},
        "gate": {"min_target_prob": 0.05},
    },
}
# Cache, budget and context small enough that a mixed batch must preempt: 12 blocks of 16
# tokens hold two or three of the growing sequences; a 16-token budget chunks every prefill.
SMALL = {
    "kv_cache": {"num_blocks": 12},
    "scheduler": {"max_num_batched_tokens": 16, "max_model_len": 160},
}
ROOMY = {"kv_cache": {"num_blocks": 256}}


@dataclasses.dataclass
class Variant:
    methods: list[str]
    decoder: dict
    roomy: LLM
    small: LLM


@pytest.fixture(scope="module")
def other_shape_model_dir(tmp_path_factory):
    """A random draft with the tiny model's vocabulary but 2 layers, 1 KV head, width 32."""
    return save_tiny_model(
        tmp_path_factory.mktemp("other-shape") / "llama",
        seed=7,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


@pytest.fixture(scope="module")
def expected(tiny_model_dir) -> list[list[int]]:
    reference = LLM(model=str(tiny_model_dir), **ROOMY)
    return [out.token_ids for out in reference.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tiny_model_dir, tiny_draft_model_dir, other_shape_model_dir) -> Variant:
    spec = dict(VARIANTS[request.param])
    methods = spec.pop("methods")
    drafts = {"separate": tiny_draft_model_dir, "other-shape": other_shape_model_dir}
    model = spec["draft"]["model"]
    spec["draft"] = {**spec["draft"], "model": str(drafts.get(model, model))}
    decoder = {
        "method": methods[0],
        "extra_methods": methods[1:],
        "num_speculative_tokens": 4,
        "draft_policy": "fixed",  # k every step: these tests are about what drafting does
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
        **spec,
    }
    model_dir = str(tiny_model_dir)
    return Variant(
        methods,
        decoder,
        LLM(model=model_dir, decoder=decoder, **ROOMY),
        LLM(model=model_dir, decoder=decoder, **SMALL),
    )


# ---- helpers -------------------------------------------------------------------------------
def mixed_batch(methods: list[str]) -> list[tuple[str, int, SpeculativeOptions]]:
    """(request id, prompt index, decoder choice): every prompt with every loaded decoder and
    with plain decoding, the requests' own k varied."""
    requests = []
    for i in range(len(PROMPTS)):
        for j, method in enumerate(["autoregressive", *methods]):
            k = (None, 1, 3)[(i + j) % 3]
            requests.append((f"{method}-{i}-k{k}", i, SpeculativeOptions(method, k)))
    return requests


def add_all(engine, requests) -> None:
    for rid, i, options in requests:
        engine.add_request(rid, PROMPTS[i], GREEDY, options)


def drain(engine) -> dict[str, list]:
    """Step until nothing is left; returns each finished request's outputs."""
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs
    return finished


def assert_nothing_leaked(engine) -> None:
    bm = engine.block_manager
    assert bm.num_used_blocks == 0
    assert all(block.ref_count == 0 for block in bm.blocks)
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.has_unfinished_requests()


def record_proposals(engine, monkeypatch) -> dict[str, list[tuple[str, int, int]]]:
    """Per decoder, (request id, drafts granted, drafts proposed) of every proposal made."""
    log: dict[str, list[tuple[str, int, int]]] = {}
    for name, decoder in engine.speculator.decoders.items():
        monkeypatch.setattr(
            decoder, "propose", _recording(decoder.propose, log.setdefault(name, []))
        )
    return log


def _recording(propose, entries: list):
    def recorded(seqs, num_drafts):
        proposals = propose(seqs, num_drafts)
        entries.extend(
            (s.request_id, num_drafts[s], len(p.token_ids)) for s, p in proposals.items()
        )
        return proposals

    return recorded


def model_drafters(variant: Variant) -> list[str]:
    return [m for m in variant.methods if m != "ngram"]


# ---- greedy identity -----------------------------------------------------------------------
def test_each_decoder_alone_equals_autoregressive(variant, expected, monkeypatch):
    engine = variant.roomy.engine
    by_decoder = engine.speculator.stats_by_decoder
    log = record_proposals(engine, monkeypatch)
    for method in variant.methods:
        drafts_before = by_decoder[method].num_drafts
        for i, prompt in enumerate(PROMPTS):
            engine.add_request("alone", prompt, GREEDY, SpeculativeOptions(method))
            got = drain(engine)["alone"][0].token_ids
            assert got == expected[i], f"{method} on prompt {i}"
        assert by_decoder[method].num_drafts > drafts_before, f"{method} never drafted"
    assert_nothing_leaked(engine)
    window = variant.decoder.get("window", {}).get("policy", "fixed")
    for method in model_drafters(variant):
        granted_vs_proposed = [(g, n) for _, g, n in log[method]]
        if window == "fixed":
            # A fixed window drafts every slot it was granted.
            assert all(n == g for g, n in granted_vs_proposed), method
        else:
            # The window both stopped short of the grant and let drafting go on.
            assert any(n < g for g, n in granted_vs_proposed), method
            assert any(n > 1 for g, n in granted_vs_proposed), method
    if variant.decoder.get("gate"):
        assert engine.speculator.gate.num_gated > 0


def test_decoders_mixed_in_one_batch_equal_autoregressive(variant, expected):
    engine = variant.roomy.engine
    by_decoder = engine.speculator.stats_by_decoder
    before = {m: by_decoder[m].num_drafts for m in variant.methods}
    requests = mixed_batch(variant.methods)
    add_all(engine, requests)
    finished = drain(engine)
    for rid, i, _ in requests:
        assert finished[rid][0].token_ids == expected[i], rid
    assert all(by_decoder[m].num_drafts > before[m] for m in variant.methods)
    assert_nothing_leaked(engine)


def test_preemption_keeps_every_decoder_identical(variant, expected):
    engine = variant.small.engine
    by_decoder = engine.speculator.stats_by_decoder
    before = {m: by_decoder[m].num_drafts for m in variant.methods}
    preemptions_before = engine.scheduler.num_preemptions
    requests = mixed_batch(variant.methods)
    add_all(engine, requests)
    finished = drain(engine)
    for rid, i, _ in requests:
        assert finished[rid][0].token_ids == expected[i], rid
    assert engine.scheduler.num_preemptions > preemptions_before
    assert all(by_decoder[m].num_drafts > before[m] for m in variant.methods)
    assert_nothing_leaked(engine)


def test_aborts_mid_draft_leave_the_others_identical(variant, expected, monkeypatch):
    engine = variant.small.engine
    log = record_proposals(engine, monkeypatch)
    requests = mixed_batch(variant.methods)
    add_all(engine, requests)
    # Two greedy continuations of one request: one of them is aborted on its own.
    pair = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, n=2)
    engine.add_request("pair", PROMPTS[0], pair, SpeculativeOptions(variant.methods[0]))
    finished, aborted, pair_split = {}, set(), False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs
        drafted = {rid for entries in log.values() for rid, _, _ in entries}
        # Abort requests with drafts in flight (they drafted and are running), while others
        # are still drafting; and one continuation of the pair once it drafted.
        running = {seq.request_id for seq in engine.scheduler.running}
        victims = sorted((drafted & running) - aborted - {"pair"})[: 2 * (len(aborted) < 5)]
        for rid in victims:
            assert engine.abort(rid).outputs[0].finish_reason == "abort"
            aborted.add(rid)
        if "pair" in drafted and not pair_split and "pair" not in finished:
            assert engine.abort_sequence("pair", 1)
            pair_split = True
    assert len(aborted) >= 4 and pair_split, "too few requests were aborted while drafting"
    survivors = [(rid, i) for rid, i, _ in requests if rid not in aborted]
    for rid, i in survivors:
        assert finished[rid][0].token_ids == expected[i], rid
    pair_outputs = finished["pair"]
    assert pair_outputs[0].token_ids == expected[0]
    assert pair_outputs[1].finish_reason == "abort"
    assert_nothing_leaked(engine)
    # Whatever the aborted requests left behind does not touch the next ones.
    again = mixed_batch(variant.methods)[: len(variant.methods) + 1]
    add_all(engine, again)
    finished = drain(engine)
    for rid, i, _ in again:
        assert finished[rid][0].token_ids == expected[i], rid
    assert_nothing_leaked(engine)


def test_a_separate_draft_model_keeps_its_cache_in_step(tiny_model_dir, tiny_draft_model_dir):
    """The separate draft reads its own KV cache, caught up lazily after each verification
    and rebuilt after preemption: if any of that went stale, its drafts would stop agreeing
    with the target (greedy output cannot show it, acceptance does)."""
    decoder = {
        "method": "draft",
        "num_speculative_tokens": 4,
        "draft_policy": "fixed",
        "draft": {"model": str(tiny_draft_model_dir), "quantization": "none"},
    }
    rates = []
    for overrides in (ROOMY, SMALL):
        llm = LLM(model=str(tiny_model_dir), decoder=decoder, **overrides)
        llm.generate(PROMPTS, GREEDY)
        rates.append(llm.engine.speculator.stats.acceptance_rate)
    assert llm.engine.scheduler.num_preemptions > 0
    # The noisy copy's greedy drafts agree with the target about half the time, whatever the
    # batch; stale K/V (say, kept across a preemption) would bring that down towards chance.
    assert rates[0] > 0.4 and rates[1] > 0.8 * rates[0], rates


# ---- window policies and the gate, exactly -----------------------------------------------
def drafted(num_drafts: int, entropies: list[float] | None = None) -> Proposal:
    return Proposal(list(range(num_drafts)), entropies=entropies or [])


def test_fixed_window_always_drafts_on():
    window = build_window(WindowConfig(policy="fixed"))
    assert isinstance(window, FixedWindow)
    assert window.keep_drafting(0.0, 100.0)
    window.on_verified(drafted(4), 0)
    assert window.keep_drafting(0.0, 100.0)


def test_adaptive_exit_raises_gamma_while_acceptance_is_low_and_lowers_it_when_high():
    config = WindowConfig(
        policy="adaptive_exit",
        gamma=0.6,
        target_acceptance=0.8,
        step=0.01,
        acceptance_smoothing=0.5,
        gamma_smoothing=0.9,
    )
    window = build_window(config)
    assert isinstance(window, AdaptiveDraftExit)
    assert window.keep_drafting(0.6, 9.0) and not window.keep_drafting(0.59, 0.0)
    # None of 4 accepted: acceptance 0.5 * 0.8 + 0.5 * 0 = 0.4 <= 0.8, so gamma moves a step
    # up, smoothed: 0.9 * 0.6 + 0.1 * 0.61.
    window.on_verified(drafted(4), 0)
    assert window.acceptance == pytest.approx(0.4)
    assert window.gamma == pytest.approx(0.601)
    for _ in range(20):
        previous = window.gamma
        window.on_verified(drafted(4), 1)
        assert window.gamma > previous
    assert not window.keep_drafting(0.6, 0.0)  # now stricter than the initial 0.6
    # All accepted: acceptance climbs past 0.8 within a few runs, then gamma only falls.
    for _ in range(3):
        window.on_verified(drafted(4), 4)
    assert window.acceptance > 0.8
    for _ in range(20):
        previous = window.gamma
        window.on_verified(drafted(4), 4)
        assert window.gamma < previous
    # An empty proposal tells nothing.
    state = (window.gamma, window.acceptance)
    window.on_verified(drafted(0), 0)
    assert (window.gamma, window.acceptance) == state


def test_adaptive_exit_gamma_stays_a_probability():
    window = AdaptiveDraftExit(WindowConfig(gamma=0.99, step=0.5, gamma_smoothing=0.0))
    for _ in range(5):
        window.on_verified(drafted(2), 0)
        assert 0.0 <= window.gamma <= 1.0
    assert window.gamma == 1.0
    window = AdaptiveDraftExit(WindowConfig(gamma=0.01, step=0.5, gamma_smoothing=0.0))
    for _ in range(5):
        window.on_verified(drafted(2), 2)
    assert window.gamma == 0.0


def test_entropy_window_tau_is_the_mean_entropy_of_rejected_drafts():
    window = build_window(WindowConfig(policy="entropy", tau=2.0))
    assert isinstance(window, EntropyWindow)
    assert window.keep_drafting(0.0, 2.0) and not window.keep_drafting(1.0, 2.01)
    # The first rejected draft is position 1 (entropy 3.0): tau = mean(2.0, 3.0).
    window.on_verified(drafted(3, [1.0, 3.0, 5.0]), 1)
    assert window.tau == pytest.approx(2.5)
    # Everything accepted: no rejected draft, no change.
    window.on_verified(drafted(3, [7.0, 8.0, 9.0]), 3)
    assert window.tau == pytest.approx(2.5)
    # Rejected at position 0 (entropy 1.0): tau = mean(2.0, 3.0, 1.0).
    window.on_verified(drafted(2, [1.0, 6.0]), 0)
    assert window.tau == pytest.approx(2.0)
    window.on_verified(drafted(1, [8.0]), 0)
    assert window.tau == pytest.approx(3.5)
    assert window.keep_drafting(0.0, 3.5) and not window.keep_drafting(0.0, 3.6)


def sequence(name: str) -> Sequence:
    return Sequence(name, name, [1, 2, 3], SamplingParams(), None)


def test_gate_holds_a_sequence_back_while_the_target_is_unsure():
    gate = TargetConfidenceGate(0.5)
    a, b = sequence("a"), sequence("b")
    assert gate.enabled
    assert gate.allows(a) and gate.allows(b)  # nothing observed yet: draft
    gate.observe(a, 0.49)
    gate.observe(b, 0.5)  # at the threshold: confident enough
    assert not gate.allows(a) and gate.allows(b)
    assert gate.num_gated == 1
    gate.observe(a, 0.9)
    assert gate.allows(a)
    gate.observe(b, 0.1)
    assert not gate.allows(b) and not gate.allows(b)
    assert gate.num_gated == 3


def test_a_gate_without_threshold_never_gates():
    gate = TargetConfidenceGate(None)
    seq = sequence("a")
    gate.observe(seq, 0.0)
    assert not gate.enabled and gate.allows(seq) and gate.num_gated == 0
