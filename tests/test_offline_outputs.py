"""What the engine hands back each step, and the offline stream (issue 11 item 7): outputs
share the sequence's lists instead of copying them every step, yet each one still reads as of
its own step; the offline stream decodes only new tokens and its pieces concatenate to
``generate``'s text, a stop token's text left out as there."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def test_step_outputs_are_snapshots_over_the_sequences_own_lists(tiny_model_dir):
    engine = LLM(model=str(tiny_model_dir), decoder={"method": "ngram"}).engine
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    engine.add_request("r", [5, 6, 7, 8] * 5, params)
    steps = []
    while engine.has_unfinished_requests():
        steps += [out.outputs[0] for out in engine.step()]
    final = steps[-1]
    assert len(final.token_ids) == 24 and final.finished
    assert all(s.all_token_ids is final.all_token_ids for s in steps)  # never copied
    assert [t for s in steps for t in s.new_token_ids] == final.token_ids
    assert [e for s in steps for e in s.new_logprobs] == final.logprobs
    for s in steps:  # an earlier step's output still reads as it was at that step
        assert s.token_ids == final.token_ids[: s.num_tokens]
        assert s.finished == (s is final)
    assert any(s.num_new_tokens > 1 for s in steps)  # speculation emitted several at once


def test_offline_stream_concatenates_to_the_generated_text(tiny_chat_model_dir):
    llm = LLM(model=str(tiny_chat_model_dir))
    prompt = "Tell me about the sea."
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    generated = llm.generate([prompt], free)[0]
    assert "".join(llm.stream(prompt, free)) == generated.text != ""
    # Ended by a stop token: neither shows that token's text.
    stop = SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[generated.token_ids[12]]
    )
    stopped = llm.generate([prompt], stop)[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) <= 13
    assert "".join(llm.stream(prompt, stop)) == stopped.text
