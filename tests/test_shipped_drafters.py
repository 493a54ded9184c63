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


@pytest.mark.parametrize("kind", ["medusa", "hydra", "eagle", "kangaroo"])
def test_shipped_drafter_is_accepted_and_lossless_on_smollm2(smollm2_path, smollm2_llm, kind):
    llm = LLM(model=str(smollm2_path), decoder={"method": kind, "num_speculative_tokens": 4})
    expected = [o.token_ids for o in smollm2_llm.chat(CHATS, GREEDY)]
    got = [o.token_ids for o in llm.chat(CHATS, GREEDY, SpeculativeOptions(kind))]
    assert got == expected
    stats = llm.engine.speculator.stats_by_decoder[kind]
    # A trained drafter's first draft is right far more often than chance (1 in 49152).
    assert stats.num_drafts > 0 and stats.accepted_per_position[0] / stats.num_drafts > 0.1
