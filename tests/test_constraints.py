"""Constrained decoding in the engine: the matcher follows any history (drafts, rollbacks),
greedy constrained output is identical with and without speculation (chains and trees), and
sampled constrained output follows the target's distribution masked and renormalised."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest
import torch

from engine import LLM, SamplingParams
from engine.constraints import ConstraintSpec
from tests.stats import chi_square_p_value
from tests.tiny_models import save_heads_drafter, save_perturbed_copy

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 4},
    },
    "required": ["ok", "n", "tags"],
    "additionalProperties": False,
}
CHOICES = ["red", "green", "grey", "blue", "black"]


@pytest.fixture(scope="module")
def llm(tiny_chat_model_dir):
    return LLM(model=str(tiny_chat_model_dir))


@pytest.fixture(scope="module")
def chat_draft_dir(tiny_chat_model_dir, tmp_path_factory):
    """A draft model for the tiny chat model: its weights plus noise, the same tokenizer."""
    path = save_perturbed_copy(tiny_chat_model_dir, tmp_path_factory.mktemp("draft") / "m", 0.02)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_chat_model_dir / name, path / name)
    return path


def test_state_follows_drafts_and_rollbacks(llm):
    factory = llm.engine.constraints
    state = factory.state(ConstraintSpec("choice", CHOICES))
    tokenizer = llm.tokenizer
    red = tokenizer.encode("red", add_special_tokens=False)
    first = state.allowed([])
    assert first[red[0]] and first.sum() < 50  # only starts of the choices
    assert not state.allowed(red)[red[0]]  # "red" is complete: only the end may follow
    assert state.allowed(red)[sorted(llm.engine.eos_token_ids)[0]]
    bad = tokenizer.encode("purple", add_special_tokens=False)
    assert state.allowed(bad) is None  # a history that breaks the constraint
    assert torch.equal(state.allowed([]), first)  # and the matcher was not spoiled by it
    assert state.consumed == []


def test_unusable_constraints_raise_naming_the_problem(llm):
    for spec, words in [
        (ConstraintSpec("json_schema", {"type": "array", "uniqueItems": True}), "uniqueItems"),
        (ConstraintSpec("regex", "[a-"), "regex"),
        (ConstraintSpec("choice", []), "choices"),
    ]:
        with pytest.raises(ValueError, match=words):
            llm.generate(["Hi"], SamplingParams(max_tokens=2, constraint=spec))
    assert not llm.engine.has_unfinished_requests()


def _json_params(**kw):
    return SamplingParams(max_tokens=120, constraint=ConstraintSpec("json_schema", SCHEMA), **kw)


def test_sampled_json_always_parses(llm):
    outs = llm.generate(["A", "B", "C"], _json_params(temperature=1.0, seed=7, n=4))
    for out in outs:
        for choice in out.outputs:
            assert choice.finish_reason == "stop"
            data = json.loads(choice.text)
            assert set(data) == {"ok", "n", "tags"} and 0 <= data["n"] <= 999


DECODERS = {
    "ngram": {"method": "ngram"},
    "ngram-tree": {"method": "ngram", "prompt_lookup_candidates": 4},
    "draft": {"method": "draft"},
    "medusa": {"method": "medusa"},
    "hydra": {"method": "hydra"},
}


def _decoder_config(name, chat_draft_dir, tiny_chat_model_dir, tmp_path_factory):
    config = {**DECODERS[name], "draft_policy": "fixed", "num_speculative_tokens": 4}
    if name == "draft":
        config["draft"] = {"model": str(chat_draft_dir)}
    if name in ("medusa", "hydra"):
        drafter = save_heads_drafter(tiny_chat_model_dir, tmp_path_factory.mktemp(name) / "d", name)
        config[name] = {"drafter": str(drafter)}
    return config


@pytest.mark.parametrize("decoder", list(DECODERS))
def test_greedy_constrained_output_is_identical_with_speculation(
    decoder, llm, tiny_chat_model_dir, chat_draft_dir, tmp_path_factory
):
    prompts = ["Write JSON:", "Another one", "x y z"]
    params = _json_params(temperature=0)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    config = _decoder_config(decoder, chat_draft_dir, tiny_chat_model_dir, tmp_path_factory)
    spec_llm = LLM(model=str(tiny_chat_model_dir), decoder=config)
    got = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params)]
    assert got == expected
    assert spec_llm.engine.speculator.stats.num_draft_tokens > 0  # it did draft


def _exact_choice_distribution(model_dir, prompt, eos) -> dict[str, float]:
    """P(output text) under the target at temperature 1, each step's distribution masked to
    the tokens the choice constraint allows and renormalised, summed over tokenizations."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    from engine.constraints.state import ConstraintFactory

    factory = ConstraintFactory(lambda: tokenizer, model.config.vocab_size, eos)
    matcher = factory.state(ConstraintSpec("choice", CHOICES))
    probs: dict[str, float] = Counter()

    def walk(history: list[int], p: float) -> None:
        allowed = matcher.allowed(history)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + history])).logits[0, -1]
        masked = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
        for token in allowed.nonzero().flatten().tolist():
            q = p * masked[token].item()
            if token in eos:
                probs[tokenizer.decode(history)] += q
            else:
                walk(history + [token], q)

    walk([], 1.0)
    return probs


def test_sampled_constrained_output_follows_the_masked_target(
    tiny_chat_model_dir, chat_draft_dir, tmp_path_factory
):
    """With a draft model proposing (its q masked too), 2,000 samples against the exact
    distribution of the masked-and-renormalised target."""
    config = _decoder_config("draft", chat_draft_dir, tiny_chat_model_dir, tmp_path_factory)
    spec_llm = LLM(model=str(tiny_chat_model_dir), decoder=config)
    prompt = spec_llm.tokenizer.encode("Pick a colour:")
    eos = spec_llm.engine.eos_token_ids
    exact = _exact_choice_distribution(tiny_chat_model_dir, prompt, eos)
    assert abs(sum(exact.values()) - 1) < 1e-4 and set(exact) == set(CHOICES)
    counts = Counter()
    for seed in range(10):  # seeds 200 apart: every sequence draws its own stream
        params = SamplingParams(
            temperature=1.0,
            n=200,
            seed=200 * seed,
            max_tokens=8,
            constraint=ConstraintSpec("choice", CHOICES),
        )
        counts.update(c.text for c in spec_llm.generate([prompt], params)[0].outputs)
    assert spec_llm.engine.speculator.stats.num_draft_tokens > 0
    assert set(counts) <= set(CHOICES)
    observed = torch.tensor([counts[c] for c in CHOICES], dtype=torch.float64)
    expected = torch.tensor([exact[c] for c in CHOICES], dtype=torch.float64)
    assert chi_square_p_value(observed, expected) > 1e-3, (counts, exact)


def test_a_constraint_that_can_only_end_wins_over_min_tokens(llm):
    """min_tokens masks the end; a complete choice allows only the end: no row may be left
    without a token (it would have no distribution), so the constraint wins."""
    choice = ConstraintSpec("choice", ["yes", "no"])
    for temperature in (0.0, 1.0):
        params = SamplingParams(
            temperature=temperature, seed=1, max_tokens=20, min_tokens=10, constraint=choice
        )
        out = llm.generate(["Answer:"], params)[0].outputs[0]
        assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_ignore_eos_ends_a_constraint_that_can_only_end(llm):
    # With ignore_eos the end of the grammar's language is not the end of the sequence; what
    # would follow EOS is outside every constraint, so the sequence stops there (vLLM users
    # expect ignore_eos for benchmarks, not unconstrained text after a finished document).
    choice = ConstraintSpec("choice", CHOICES)
    params = SamplingParams(temperature=1.0, seed=2, n=8, max_tokens=20, ignore_eos=True,
                            constraint=choice)  # fmt: skip
    for out in llm.generate(["Pick"], params)[0].outputs:
        assert out.finish_reason == "stop" and out.text in CHOICES, out.text
