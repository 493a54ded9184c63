"""Sampling parameters, logits processing and the sampler, on hand-built logits."""

import math
from dataclasses import dataclass, field

import pytest
import torch

from engine.sampling import (
    Sampler,
    SamplingParams,
    make_generator,
    probabilities,
    process_logits,
    sample_from_probabilities,
)

EOS = 4
# softmax(LOGITS) == PROBS; cumulative mass 0.5, 0.75, 0.9, 0.97, 1.0.
PROBS = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
LOGITS = PROBS.log()
VOCAB = len(PROBS)


@dataclass
class Row:
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)


def process_one(params: SamplingParams, logits=LOGITS, prompt=(), output=()) -> torch.Tensor:
    row = Row(params, list(prompt), list(output))
    return process_logits(logits.unsqueeze(0), [row], [EOS])[0]


def kept_tokens(processed: torch.Tensor) -> set[int]:
    return set(torch.isfinite(processed).nonzero().flatten().tolist())


def sample_frequencies(params: SamplingParams, draws: int = 4000, seed: int = 0) -> torch.Tensor:
    """Empirical token frequencies over `draws` rows of LOGITS sampled in one batch."""
    rows = [Row(params)] * draws
    generator = make_generator(seed)
    tokens = Sampler([EOS])(LOGITS.repeat(draws, 1), rows, [generator] * draws)
    ids = torch.tensor([token.token_id for token in tokens])
    return torch.bincount(ids, minlength=VOCAB).float() / draws


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * (p - q).abs().sum().item()


def entropy(probs: torch.Tensor) -> float:
    return -(probs * probs.clamp_min(1e-30).log()).sum().item()


# --- SamplingParams validation ------------------------------------------------------------------

INVALID = [
    ({"n": 0}, "n"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"top_p": -math.inf}, "top_p"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.1}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -2.1}, "presence_penalty"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
    ({"logit_bias": {5: 101}}, "logit_bias"),
    ({"logit_bias": {5: -100.5}}, "logit_bias"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": ["7"]}, "stop_token_ids"),
    ({"n": 1.5}, "n"),
    ({"top_k": 2.5}, "top_k"),
    ({"max_tokens": 8.0}, "max_tokens"),
    ({"seed": "1"}, "seed"),
    ({"temperature": "0.5"}, "temperature"),
    ({"logit_bias": {1: "x"}}, "logit_bias"),
]


@pytest.mark.parametrize(("kwargs", "name"), INVALID, ids=[str(k) for k, _ in INVALID])
def test_invalid_parameter_raises_value_error_naming_it(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name}\b.* must be .*, got "):
        SamplingParams(**kwargs)


def test_boundary_values_are_accepted_and_normalised():
    params = SamplingParams(
        temperature=0,
        top_p=1,
        top_k=-1,
        min_p=1,
        presence_penalty=-2,
        frequency_penalty=2,
        logit_bias={"5": 3, 7: -100},
        max_tokens=None,
        min_tokens=100,
        logprobs=20,
    )
    assert params.top_k == 0
    assert params.logit_bias == {5: 3.0, 7: -100.0}
    assert params.greedy
    assert not SamplingParams().greedy
    assert SamplingParams(logprobs=0).logprobs == 0


def test_validate_for_vocab_rejects_token_ids_outside_the_vocabulary():
    SamplingParams(logit_bias={9: 1.0}, stop_token_ids=[9]).validate_for_vocab(10)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={10: 1.0}).validate_for_vocab(10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[3, 10]).validate_for_vocab(10)


# --- process_logits -----------------------------------------------------------------------------


def test_default_params_do_not_change_logits():
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0, top_k=2)
    rows = [Row(SamplingParams()), Row(greedy), Row(SamplingParams())]
    assert torch.equal(process_logits(logits, rows, [EOS]), logits)


def test_processing_never_writes_the_input_and_leaves_plain_rows_alone():
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(1))
    original = logits.clone()
    busy = SamplingParams(
        temperature=0.5,
        top_k=3,
        top_p=0.9,
        min_p=0.1,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={2: 5.0},
        min_tokens=3,
    )
    rows = [Row(SamplingParams()), Row(busy, [1, 2], [3]), Row(SamplingParams())]
    processed = process_logits(logits, rows, [EOS])
    assert torch.equal(logits, original)
    assert torch.equal(processed[0], logits[0]) and torch.equal(processed[2], logits[2])
    assert not torch.equal(processed[1], logits[1])


def test_temperature_divides_logits_and_greedy_rows_are_not_scaled():
    for temperature in (0.5, 2.0):
        expected = LOGITS / temperature
        assert torch.equal(process_one(SamplingParams(temperature=temperature)), expected)
    assert torch.equal(process_one(SamplingParams(temperature=0, top_p=0.1)), LOGITS)


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.4, {0}), (0.7, {0, 1}), (0.8, {0, 1, 2}), (0.95, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3, 4})],
)
def test_top_p_keeps_exactly_the_nucleus(top_p, kept):
    processed = process_one(SamplingParams(top_p=top_p))
    assert kept_tokens(processed) == kept
    renormalised = PROBS[sorted(kept)] / PROBS[sorted(kept)].sum()
    assert torch.allclose(probabilities(processed)[sorted(kept)], renormalised, atol=1e-6)


def nucleus(logits: torch.Tensor, top_p: float) -> set[int]:
    """Reference top-p in float64: the most likely tokens until their mass reaches top_p."""
    probs, order = logits.double().softmax(dim=-1).sort(descending=True)
    size = int((probs.cumsum(dim=-1) < top_p).sum()) + 1
    return set(order[:size].tolist())


def test_top_p_on_a_large_vocabulary_matches_the_definition():
    vocab = 1000
    shuffle = torch.randperm(vocab, generator=torch.Generator().manual_seed(4))
    peaked = (-0.1 * torch.arange(vocab, dtype=torch.float32))[shuffle]  # nucleus of ~20 tokens
    flat = (-0.001 * torch.arange(vocab, dtype=torch.float32))[shuffle]  # nucleus of ~840 tokens
    params = SamplingParams(top_p=0.9)
    alone = process_logits(peaked.unsqueeze(0), [Row(params)], [EOS])
    both = process_logits(torch.stack([peaked, flat]), [Row(params), Row(params)], [EOS])
    assert kept_tokens(alone[0]) == kept_tokens(both[0]) == nucleus(peaked, 0.9)
    assert kept_tokens(both[1]) == nucleus(flat, 0.9)
    assert len(kept_tokens(both[1])) > 256  # beyond the top candidates: the full-sort path


@pytest.mark.parametrize(("min_p", "kept"), [(0.1, {0, 1, 2, 3}), (0.2, {0, 1, 2}), (0.4, {0, 1})])
def test_min_p_masks_tokens_below_a_fraction_of_the_top_probability(min_p, kept):
    assert kept_tokens(process_one(SamplingParams(min_p=min_p))) == kept


def test_top_k_then_top_p_then_min_p_compose():
    # top_k=3 leaves probabilities 0.555, 0.278, 0.167: top_p=0.8 then keeps the first two.
    assert kept_tokens(process_one(SamplingParams(top_k=3, top_p=0.8))) == {0, 1}
    # top_k=4 renormalises to 0.515, 0.258, 0.155, 0.072: min_p=0.2 drops the last.
    assert kept_tokens(process_one(SamplingParams(top_k=4, min_p=0.2))) == {0, 1, 2}


def test_repetition_penalty_scales_tokens_seen_in_prompt_and_output():
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 0.5, 3.0])
    params = SamplingParams(repetition_penalty=2.0)
    processed = process_one(params, logits, prompt=[0], output=[1, 1])
    assert processed.tolist() == [1.0, -4.0, 1.0, -1.0, 0.5, 3.0]


@pytest.mark.parametrize(("frequency", "presence"), [(0.5, 1.0), (-0.5, 0.0), (0.0, -1.5)])
def test_frequency_and_presence_penalties_subtract_from_output_tokens_only(frequency, presence):
    params = SamplingParams(frequency_penalty=frequency, presence_penalty=presence)
    processed = process_one(params, torch.zeros(6), prompt=[5], output=[2, 2, 3])
    expected = [0.0, 0.0, -(2 * frequency + presence), -(frequency + presence), 0.0, 0.0]
    assert processed.tolist() == pytest.approx(expected)


def test_penalties_in_a_mixed_batch_touch_only_their_own_rows():
    rows = [
        Row(SamplingParams()),
        Row(SamplingParams(repetition_penalty=2.0), [0], []),
        Row(SamplingParams(frequency_penalty=1.0, presence_penalty=0.5), [1], [0, 0]),
        Row(SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0)),  # nothing seen yet
    ]
    processed = process_logits(torch.full((4, VOCAB), 2.0), rows, [EOS])
    expected = torch.full((4, VOCAB), 2.0)
    expected[1, 0] = 1.0
    expected[2, 0] = 2.0 - 2 * 1.0 - 0.5
    assert torch.equal(processed, expected)


def test_rows_of_one_request_with_different_outputs_get_their_own_penalties():
    # A speculative verifier passes one row per draft position, sharing one params object.
    params = SamplingParams(frequency_penalty=1.0)
    rows = [Row(params, [0], []), Row(params, [0], [1]), Row(params, [0], [1, 1])]
    processed = process_logits(torch.zeros(3, VOCAB), rows, [EOS])
    assert processed[:, 1].tolist() == [0.0, -1.0, -2.0]


def test_logit_bias_is_added_to_the_named_tokens():
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    processed = process_one(SamplingParams(logit_bias={1: 2.5, "3": -1.0}), logits)
    assert processed.tolist() == [1.0, 4.5, 3.0, 3.0, 5.0]


def test_logit_bias_plus_100_forces_and_minus_100_bans_a_token():
    assert sample_frequencies(SamplingParams(logit_bias={4: 100}), draws=500)[4] == 1.0
    banned = sample_frequencies(SamplingParams(logit_bias={0: -100}), draws=2000)
    assert banned[0] == 0.0 and (banned[1:] > 0).all()


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    params = SamplingParams(min_tokens=2, stop_token_ids=[3])
    for output in ([], [0]):
        assert kept_tokens(process_one(params, output=output)) == {0, 1, 2}
    assert kept_tokens(process_one(params, output=[0, 0])) == set(range(VOCAB))
    ignore_eos = SamplingParams(min_tokens=2, stop_token_ids=[3], ignore_eos=True)
    assert kept_tokens(process_one(ignore_eos, output=[0])) == {0, 1, 2, 4}


def test_greedy_with_min_tokens_picks_the_best_non_stop_token():
    logits = torch.tensor([[1.0, 2.0, 0.0, 0.0, 5.0]])  # EOS is the argmax
    params = SamplingParams(temperature=0, min_tokens=1)
    sampler = Sampler([EOS])
    assert sampler(logits, [Row(params)], [None])[0].token_id == 1
    assert sampler(logits, [Row(params, output_token_ids=[1])], [None])[0].token_id == EOS


# --- Sampling ------------------------------------------------------------------------------------


def test_an_empty_batch_samples_nothing():
    assert Sampler([EOS])(torch.empty(0, VOCAB), [], []) == []


def test_top_k_1_equals_greedy():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(2))
    rows = [Row(SamplingParams(top_k=1, temperature=1.5)) for _ in range(8)]
    generators = [make_generator(seed) for seed in range(8)]
    tokens = [t.token_id for t in Sampler([EOS])(logits, rows, generators)]
    assert tokens == logits.argmax(dim=-1).tolist()


def test_top_k_2_samples_only_the_top_two_in_proportion():
    frequencies = sample_frequencies(SamplingParams(top_k=2))
    assert frequencies[2:].sum() == 0
    assert frequencies[0].item() == pytest.approx(2 / 3, abs=0.04)


def test_lower_temperature_is_sharper_and_higher_is_flatter():
    temperatures = (0.5, 1.0, 2.0)
    entropies = [
        entropy(probabilities(process_one(SamplingParams(temperature=t)))) for t in temperatures
    ]
    assert entropies[0] < entropies[1] < entropies[2]
    top_frequency = [sample_frequencies(SamplingParams(temperature=t))[0] for t in temperatures]
    # Expected 0.73, 0.50 and 0.35.
    assert top_frequency[0] > 0.68 and 0.45 < top_frequency[1] < 0.55 and top_frequency[2] < 0.40


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_sampling_frequencies_match_the_softmax_distribution(temperature):
    expected = PROBS ** (1 / temperature)
    expected /= expected.sum()
    frequencies = sample_frequencies(SamplingParams(temperature=temperature), draws=20000)
    assert total_variation(frequencies, expected) < 0.03


def test_inverse_cdf_never_returns_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0]]).repeat(5, 1)
    uniforms = torch.tensor([0.0, 0.4999, 0.5, 1.0 - 1e-12, 1.0], dtype=torch.float64)
    assert sample_from_probabilities(probs, uniforms).tolist() == [1, 1, 2, 2, 2]
    unnormalised = torch.tensor([[0.0, 2.0, 2.0, 0.0]])
    assert sample_from_probabilities(unnormalised, torch.tensor([0.75])).tolist() == [2]


@pytest.mark.parametrize("vocab", [2048, 3000])
def test_blocked_inverse_cdf_matches_a_full_float64_cdf(vocab):
    generator = torch.Generator().manual_seed(5)
    probs = torch.rand(4, vocab, generator=generator) ** 4
    probs[:, :1024] = 0  # a whole block without mass
    probs[:, ::7] = 0
    probs[3, :-5] = 0  # all mass in the last block (padded when vocab is 3000)
    for _ in range(50):
        uniforms = torch.rand(4, generator=generator, dtype=torch.float64)
        cdf = probs.double().cumsum(dim=-1)
        expected = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(-1), right=True)
        assert sample_from_probabilities(probs, uniforms).tolist() == expected.flatten().tolist()


def test_probabilities_of_a_fully_masked_row_are_uniform_not_nan():
    logits = torch.stack([LOGITS, torch.full((VOCAB,), float("-inf"))])
    probs = probabilities(logits)
    assert torch.allclose(probs[0], PROBS)
    assert torch.equal(probs[1], torch.full((VOCAB,), 1 / VOCAB))


def test_make_generator_is_reproducible_for_a_seed_and_fresh_without_one():
    def draws(generator):
        return torch.rand(4, generator=generator).tolist()

    assert draws(make_generator(3)) == draws(make_generator(3))
    assert draws(make_generator(3)) != draws(make_generator(4))
    assert draws(make_generator(None)) != draws(make_generator(None))
    assert draws(make_generator(-1)) == draws(make_generator(2**64 - 1))  # any int is accepted


def _seeded_sequence(seed: int, position: int, batch_size: int, steps: int = 20) -> list[int]:
    """Tokens of one seeded request decoded inside a batch of unrelated, unseeded requests."""
    vocab = 32
    target = Row(SamplingParams(temperature=0.9, top_k=20, frequency_penalty=0.3, seed=seed))
    others = [Row(SamplingParams(temperature=1.3)) for _ in range(batch_size - 1)]
    rows = others[:position] + [target] + others[position:]
    generators: list = [None] * batch_size
    generators[position] = make_generator(seed)
    noise = torch.Generator().manual_seed(1000 + batch_size)
    sampler = Sampler([EOS])
    for step in range(steps):
        logits = torch.randn(batch_size, vocab, generator=noise)
        logits[position] = torch.randn(vocab, generator=torch.Generator().manual_seed(step))
        for row, token in zip(rows, sampler(logits, rows, generators), strict=True):
            row.output_token_ids.append(token.token_id)
    return target.output_token_ids


def test_a_seeded_request_gets_the_same_tokens_whatever_the_batch():
    alone = _seeded_sequence(seed=7, position=0, batch_size=1)
    assert len(set(alone)) > 3  # it really samples
    assert _seeded_sequence(seed=7, position=2, batch_size=5) == alone
    assert _seeded_sequence(seed=7, position=6, batch_size=7) == alone
    assert _seeded_sequence(seed=8, position=0, batch_size=1) != alone


def test_logprobs_are_the_raw_log_softmax_with_sorted_top_tokens():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(3))
    rows = [
        Row(SamplingParams(temperature=0.5, top_k=2, logprobs=3)),
        Row(SamplingParams(temperature=0, logprobs=0)),
        Row(SamplingParams()),
    ]
    results = Sampler([EOS])(logits, rows, [make_generator(0), None, None])
    raw = torch.log_softmax(logits, dim=-1)

    first = results[0]
    assert first.logprob == pytest.approx(raw[0, first.token_id].item(), abs=1e-6)
    top_values, top_ids = raw[0].topk(3)
    assert [token for token, _ in first.top_logprobs] == top_ids.tolist()
    assert [value for _, value in first.top_logprobs] == pytest.approx(top_values.tolist())
    assert [value for _, value in first.top_logprobs] == sorted(
        (value for _, value in first.top_logprobs), reverse=True
    )
    processed = torch.log_softmax(process_one(rows[0].sampling_params, logits[0]), dim=-1)
    assert abs(first.logprob - processed[first.token_id].item()) > 1e-3

    assert results[1].token_id == logits[1].argmax().item()
    assert results[1].logprob == pytest.approx(raw[1].max().item(), abs=1e-6)
    assert results[1].top_logprobs == []
    assert results[2].logprob is None and results[2].top_logprobs is None


def test_tiny_temperature_is_greedy_not_an_overflow():
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    row = Row(SamplingParams(temperature=1e-40))
    sampler = Sampler(eos_token_ids=[])
    picks = {sampler(logits, [row], [make_generator(i)])[0].token_id for i in range(20)}
    assert picks == {1}


def test_greedy_tokens_take_the_first_of_tied_maxima_as_argmax_does():
    from engine.sampling import greedy_tokens

    logits = torch.randn(33, 1000)
    logits[3, [7, 500, 999]] = 50.0  # ties: the first index wins
    logits[4] = float("-inf")
    logits[4, [2, 3]] = 0.0
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    assert greedy_tokens(logits)[3] == 7 and greedy_tokens(logits)[4] == 2
