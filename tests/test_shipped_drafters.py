"""The drafters shipped for the embedded model (engine/drafters/) on the real SmolLM2: they load
by default, propose drafts (trees, chains) the target accepts, and greedy output stays
identical to plain decoding."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.decoders import SpeculativeOptions

CHATS = [
    [{"role": "user", "content": "How do I keep a sourdough starter alive?"}],
    [{"role": "user", "content": "Write two sentences about lighthouses."}],
]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


@pytest.mark.parametrize("kind", ["medusa", "hydra", "eagle", "eagle3", "kangaroo"])
def test_shipped_drafter_is_accepted_and_lossless_on_smollm2(smollm2_path, smollm2_llm, kind):
    # Fixed k: every step drafts, so the acceptance read below is the drafter's, not the
    # goodput policy's verdict on this machine's step costs (on an Intel Xeon it stopped
    # drafting medusa after two unlucky first runs, leaving nothing to read).
    decoder = {"method": kind, "num_speculative_tokens": 4, "draft_policy": "fixed"}
    llm = LLM(model=str(smollm2_path), decoder=decoder)
    expected = [o.token_ids for o in smollm2_llm.chat(CHATS, GREEDY)]
    got = [o.token_ids for o in llm.chat(CHATS, GREEDY, SpeculativeOptions(kind))]
    assert got == expected
    stats = llm.engine.speculator.stats_by_decoder[kind]
    # A trained drafter's first draft is right far more often than chance (1 in 49152).
    assert stats.num_drafts > 0 and stats.accepted_per_position[0] / stats.num_drafts > 0.1


def test_the_default_engine_loads_them_and_plain_requests_stay_plain(smollm2_llm):
    engine = smollm2_llm.engine  # the default config
    assert {"medusa", "hydra", "eagle", "eagle3", "kangaroo", "hybrid"} <= set(
        engine.loaded_decoders
    )
    spec = engine.speculator
    plain_steps = []
    original = spec.plain_step

    def counting(scheduled, proposals):
        plain_steps.append(original(scheduled, proposals))
        return plain_steps[-1]

    spec.plain_step = counting
    try:
        plain = smollm2_llm.chat(CHATS[:1], GREEDY)[0].token_ids
        # Loaded but unused, the drafters cost nothing per step.
        assert plain_steps and all(plain_steps)
        picked = smollm2_llm.chat(CHATS[:1], GREEDY, SpeculativeOptions("eagle"))[0].token_ids
    finally:
        spec.plain_step = original
    assert picked == plain and not all(plain_steps)


def test_hybrid_with_the_shipped_heads_is_lossless_on_smollm2(smollm2_path, smollm2_llm):
    """Prompt lookup on a prompt the answer copies from, the shipped Hydra heads elsewhere:
    greedy output is plain decoding's, and both sources had drafts accepted."""
    chats = [
        *CHATS,
        [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog "
          "near the quiet river bank at dawn."}],
    ]  # fmt: skip
    decoder = {"method": "hybrid", "num_speculative_tokens": 4, "draft_policy": "fixed"}
    llm = LLM(model=str(smollm2_path), decoder=decoder)
    hybrid = llm.engine.speculator.decoders["hybrid"]
    accepted: dict[str, int] = {}
    on_verified = hybrid.on_verified

    def counting(seq, proposal, num_accepted):
        source = hybrid.draft_source(seq)
        accepted[source] = accepted.get(source, 0) + num_accepted
        on_verified(seq, proposal, num_accepted)

    hybrid.on_verified = counting
    expected = [o.token_ids for o in smollm2_llm.chat(chats, GREEDY)]
    assert [o.token_ids for o in llm.chat(chats, GREEDY, SpeculativeOptions("hybrid"))] == expected
    assert accepted.get("hybrid:lookup", 0) > 0 and accepted.get("hybrid:hydra", 0) > 0, accepted
