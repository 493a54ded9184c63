"""Prompt logprobs: each prompt token's logprob under the model, as transformers computes it,
however the prompt is chunked, batched, cached or preempted."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.prompt_logprobs import prompt_logprobs
from tests.tiny_models import TINY_VOCAB


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(11 * i + 5 * n + salt) % (TINY_VOCAB - 3) + 3 for i in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0, :-1]
        return torch.log_softmax(logits.float(), dim=-1)

    return logprobs


def _check(entries, prompt, expected: torch.Tensor, k: int) -> None:
    assert entries[0] is None and len(entries) == len(prompt)
    for position, entry in enumerate(entries[1:]):
        row = expected[position]
        assert entry.token_id == prompt[position + 1]
        assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-4)
        value = row[entry.token_id]
        # Tokens within float tolerance of it may rank either side.
        assert (
            int((row > value + 1e-4).sum()) + 1 <= entry.rank <= int((row > value - 1e-4).sum()) + 1
        )
        assert [t for t, _ in entry.top_logprobs] == row.topk(k).indices.tolist()


def test_prompt_logprobs_match_transformers(tiny_model_dir, reference):
    llm = LLM(model=str(tiny_model_dir))
    prompt = _prompt(45)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3)
    out = llm.generate([prompt], params)[0]
    _check(out.prompt_logprobs, prompt, reference(prompt), 3)
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3))[0]
    assert plain.prompt_logprobs is None and plain.token_ids == out.token_ids


def test_chunked_batched_and_cached_prompts(tiny_model_dir, reference):
    """An 8-token budget chunks every prompt; the second request's prompt is in the prefix
    cache, which a prompt-logprobs request must not use; n > 1 computes them once."""
    llm = LLM(model=str(tiny_model_dir), scheduler={"max_num_batched_tokens": 8})
    prompts = [_prompt(40), _prompt(21, 1), _prompt(1, 2)]
    warm = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([prompts[0]], warm)  # now in the prefix cache
    asking = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=4, prompt_logprobs=0)
    outs = llm.generate(prompts, [asking, warm, asking])
    _check(outs[0].prompt_logprobs, prompts[0], reference(prompts[0]), 0)
    assert outs[0].num_cached_prompt_tokens == 0
    assert outs[1].prompt_logprobs is None
    assert outs[2].prompt_logprobs == [None]  # one token: nothing to predict it from


def test_preempted_prompt_repeats_no_entry(tiny_model_dir, reference):
    llm = LLM(
        model=str(tiny_model_dir),
        kv_cache={"num_blocks": 10, "enable_prefix_caching": False},
        scheduler={"max_num_batched_tokens": 8, "max_model_len": 160},
    )
    prompts = [_prompt(50), _prompt(33, 1), _prompt(70, 2), _prompt(12, 3)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        _check(out.prompt_logprobs, prompt, reference(prompt), 1)


def test_with_a_speculative_decoder_in_the_batch(tiny_model_dir, tiny_draft_model_dir, reference):
    llm = LLM(
        model=str(tiny_model_dir),
        decoder={
            "method": "draft",
            "draft": {"model": str(tiny_draft_model_dir)},
            "draft_policy": "fixed",
            "num_speculative_tokens": 3,
        },
        # Small chunks: the second prompt is still prefilling while the first one drafts.
        scheduler={"max_num_batched_tokens": 16},
    )
    prompts = [_prompt(8, 4), _prompt(60)]
    params = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=2),
    ]
    outs = llm.generate(prompts, params)
    assert llm.engine.speculator.stats.num_draft_tokens > 0
    _check(outs[1].prompt_logprobs, prompts[1], reference(prompts[1]), 2)


def test_ranks_count_more_likely_tokens():
    logits = torch.tensor([[0.0, 2.0, 1.0, 3.0], [5.0, 0.0, 0.0, 0.0]])
    first, second = prompt_logprobs(logits, [2, 0], k=2)
    assert first.rank == 3 and [t for t, _ in first.top_logprobs] == [3, 1]
    assert second.rank == 1 and second.logprob == pytest.approx(
        torch.log_softmax(logits[1], -1)[0].item()
    )


def test_range_is_checked():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
