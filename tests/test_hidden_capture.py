"""Hidden states captured during generation (LLM.generate(return_hidden_states=True)).

Drafter training reads the target's hidden states from the generation that wrote its answers,
so they must be the states a teacher-forced pass over prompt + answer gives, whatever the
scheduler did: batched decoding, chunked prefill, preemption (recompute) and a prompt the
prefix cache would otherwise have served.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.speculative_options import SpeculativeOptions
from tests.decoder_checks import GREEDY, PROMPTS
from tooling.training.self_distillation import final_features, generate_answers, sequence_features


def teacher_forced(model, tokens: list[int]) -> torch.Tensor:
    """Last-layer hidden states (before the final norm) at every position but the last."""
    last = model.arch.num_layers - 1
    return sequence_features(model, [tokens], layer=last)[0][:-1]


def test_captured_states_equal_a_teacher_forced_pass_batched_chunked_and_preempted(
    tiny_model_dir,
):
    plain = LLM(model=str(tiny_model_dir)).generate(PROMPTS, GREEDY)
    llm = LLM(
        model=str(tiny_model_dir),
        kv_cache={"num_blocks": 10},
        scheduler={"max_num_batched_tokens": 16, "max_model_len": 160},
    )
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1))  # its prefix is now cached
    outs = llm.generate(PROMPTS, GREEDY, return_hidden_states=True)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    for out in outs:
        tokens = list(out.prompt_token_ids) + out.token_ids
        hidden = out.outputs[0].hidden_states
        assert hidden.shape == (len(tokens) - 1, llm.engine.model.arch.hidden_size)
        torch.testing.assert_close(hidden, teacher_forced(llm.engine.model, tokens))
    assert outs[0].num_cached_prompt_tokens == 0  # every prompt position ran
    assert llm.generate([PROMPTS[0]], GREEDY)[0].outputs[0].hidden_states is None


def test_requests_that_would_draft_are_refused_and_opting_out_captures(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), decoder={"method": "ngram"})
    with pytest.raises(ValueError, match="autoregressive path only"):
        llm.generate(PROMPTS[:1], GREEDY, return_hidden_states=True)
    assert not llm.engine.has_unfinished_requests()
    plain = SpeculativeOptions(method="autoregressive")
    out = llm.generate(PROMPTS[:1], GREEDY, plain, return_hidden_states=True)[0]
    tokens = list(out.prompt_token_ids) + out.token_ids
    expected = teacher_forced(llm.engine.model, tokens)
    torch.testing.assert_close(out.outputs[0].hidden_states, expected)


def test_training_features_come_from_the_generation(tiny_model_dir):
    # What `specserve train` stores: final-normed float16 features at every position, the
    # same as the teacher-forced pass it replaced (the last position, never read, is zero).
    llm = LLM(model=str(tiny_model_dir))
    answers = generate_answers(llm, PROMPTS[:3], 12, 0.0, batch=2, with_features=True)
    model = llm.engine.model
    for tokens, features in zip(answers.sequences, answers.features, strict=True):
        reference = sequence_features(model, [tokens])[0]
        assert features.dtype == torch.float16 and features.shape == reference.shape
        torch.testing.assert_close(features[:-1].float(), reference[:-1], atol=2e-3, rtol=2e-3)
        assert not features[-1].any()
    hidden = llm.generate(PROMPTS[:1], GREEDY, return_hidden_states=True)[0].outputs[0]
    assert final_features(model, hidden.hidden_states).shape[0] == len(PROMPTS[0]) + 32


def test_several_layers_are_captured_side_by_side_and_bad_layers_refused(tiny_model_dir):
    # What `specserve train data --keep-layers` keeps: the outputs of the layers it names, in
    # its order, as a teacher-forced pass gives them.
    llm = LLM(model=str(tiny_model_dir))
    model = llm.engine.model
    last = model.arch.num_layers - 1
    out = llm.generate(PROMPTS[:2], GREEDY, return_hidden_states=(last, 0))
    for o in out:
        tokens = list(o.prompt_token_ids) + o.token_ids
        expected = sequence_features(model, [tokens], layer=(last, 0))[0][:-1]
        hidden = o.outputs[0].hidden_states
        assert hidden.shape == (len(tokens) - 1, 2 * model.arch.hidden_size)
        torch.testing.assert_close(hidden, expected)
        first = hidden[:, : model.arch.hidden_size]
        torch.testing.assert_close(first, teacher_forced(model, tokens))
    with pytest.raises(ValueError, match=f"layers \\[0, {last + 1}\\] asked for"):
        llm.generate(PROMPTS[:1], GREEDY, return_hidden_states=(0, last + 1))
    assert not llm.engine.has_unfinished_requests()
