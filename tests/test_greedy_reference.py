"""Greedy decoding on the real SmolLM2 is token-identical to transformers' generate()."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.models.loader import load_hf_model

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain in detail how photosynthesis works.",
    "List ten tips for learning a new programming language, with a sentence on each.",
]
MAX_TOKENS = 72


@pytest.mark.real_model
def test_llm_greedy_matches_transformers_generate(smollm2_llm):
    llm = smollm2_llm
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    # All three in one batch: batching must not change greedy tokens either.
    outs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    hf = load_hf_model(llm.model_dir, torch.float32)
    for conversation, out in zip(conversations, outs, strict=True):
        prompt = llm.render_chat(conversation)
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            )[0, len(prompt) :].tolist()
        assert out.token_ids == ref
        assert len(out.token_ids) >= 64, "prompt should elicit a long answer"
        assert out.finish_reason == "length"
        assert out.text.strip()
