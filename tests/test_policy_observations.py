"""What the goodput policy's cost model learns from: decode steps only (engine/speculation.py
``decode_shaped``). A prompt's pass runs other kernels than the decode curve the policy
calibrated, and while a decoder drafts every step its plain steps are mostly prompts: taken
in, they set the level at which plain decode steps were priced."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.model_runner import ForwardItem
from engine.speculation import decode_shaped

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def test_a_step_is_decode_shaped_only_when_every_item_wants_all_its_logits():
    decode = ForwardItem([7], 20, [0, 1], 1)
    drafted = ForwardItem([7, 8, 9], 20, [0, 1], 3)
    prompt = ForwardItem(list(range(12)), 0, [0], 1)
    chunk = ForwardItem(list(range(12)), 0, [0], 0)  # a prompt's middle chunk: no logits
    assert decode_shaped([decode]) and decode_shaped([decode, drafted])
    assert not decode_shaped([prompt]) and not decode_shaped([chunk])
    assert not decode_shaped([decode, prompt])  # a prompt joined by a decode


def test_the_cost_model_never_observes_a_prompt_pass(tiny_model_dir):
    decoder = {"method": "draft", "draft_policy": "goodput", "num_speculative_tokens": 3}
    llm = LLM(model=str(tiny_model_dir), decoder=decoder)
    policy = llm.engine.speculator.policy
    observed: list[tuple[int, bool]] = []
    observe = policy.observe_step

    def recording(num_tokens, seconds, keys=0, drafted=False):
        observed.append((num_tokens, drafted))
        observe(num_tokens, seconds, keys, drafted)

    policy.observe_step = recording
    prompts = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 9 + [14]]  # 30 and 28 tokens
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.generate(prompts, greedy)
    assert observed, "decode steps are observed"
    # Two sequences decoding together: at most 2 * (1 + 3) tokens; a prompt pass has 28+.
    assert max(n for n, _ in observed) <= 8, observed
    assert any(drafted for _, drafted in observed)  # drafted steps too, not only plain ones
