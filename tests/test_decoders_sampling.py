"""Every lossless decoder samples exactly what the target samples: the first three tokens of
thousands of sampled continuations follow the target's exact distributions, computed from the
target model alone, under temperature, top-k, top-p, min-p, the three penalties and logit bias.

A model of 48 tokens keeps the exact distributions cheap (every two-token continuation of the
prompt is scored) and the chi-square tests sharp. With k = 2 and max_tokens = 4, the first token
comes from the prefill and the second and third from verifying one chain of (up to) two drafts.

False alarms: each position is checked at level 1e-4, three positions per case, so a correct
engine fails a case with probability at most 3e-4 (the whole file at most ~6e-3); the seeds are
fixed, so a given engine passes or fails deterministically.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.decoders import SpeculativeOptions
from engine.draft_policy import GoodputPolicy
from engine.kv_cache import KVCache
from engine.model_runner import ForwardItem, ModelRunner
from engine.sampling import probabilities, process_logits
from tests.stats import chi_square_p_value
from tests.tiny_models import (
    save_eagle3_drafter,
    save_eagle_drafter,
    save_heads_drafter,
    save_kangaroo_drafter,
    save_perturbed_copy,
    save_tiny_model,
)

pytestmark = pytest.mark.usefixtures("single_torch_thread")

VOCAB = 48
# Every token once (7 is coprime with 48): whatever the first sampled token, prompt lookup
# finds it in the prompt, so ngram drafts for every continuation too.
PROMPT = [(7 * i + 3) % VOCAB for i in range(VOCAB)]
# Half the tokens, twice: prompt lookup finds a sampled token (and drafts) about half the time.
HALF_PROMPT = PROMPT[: VOCAB // 2] * 2
DRAWS = 2000
LEVEL = 1e-4

PARAMS = {
    "temperature-top_k-top_p-min_p": SamplingParams(
        temperature=0.8, top_k=20, top_p=0.9, min_p=0.03
    ),
    "penalties-logit_bias": SamplingParams(
        temperature=1.2,
        repetition_penalty=1.3,
        presence_penalty=0.7,
        frequency_penalty=0.5,
        logit_bias={5: 2.0, 7: -3.0},
    ),
}
# Both engines load several decoders; a request picks one. "self": drafts from the target's own
# weights (int8 copy, skipped sublayers; the hierarchy's level 2 is the int8 copy, level 1
# prompt lookup). "separate": a draft model with its own KV cache (the target plus noise), the
# hierarchy's level 1 being its first layer, and an entropy window (tau inside the model's
# range of entropies) that may stop a chain at one draft. tau2 above every entropy keeps
# level 2 drafting to k. "medusa", "hydra": random heads whose two drafts are siblings (a tree).
# "eagle": a random EAGLE layer ("eagle3": EAGLE-3's, over all three layers), "kangaroo": a
# random adapter after the first layer, whose drafts are drawn from their q; in "separate", the
# EAGLE layers draft EAGLE-2 trees of two deterministic nodes (siblings or a chain, as its
# values rank them). "hybrid" (on HALF_PROMPT): prompt lookup where the last token occurs in
# the prompt, the random EAGLE-3 layer otherwise.
DECODERS = {
    "self": {
        "method": "ngram",
        "extra_methods": [
            "draft", "layerskip", "hierarchical", "medusa", "hydra", "eagle", "eagle3",
            "kangaroo", "hybrid",
        ],  # fmt: skip
        "draft": {"model": "self", "quantization": "int8"},
        "layerskip": {"skip_attention": [1], "skip_mlp": [2]},
        "hierarchical": {"level1": "ngram", "tau2": 10.0},
        "hybrid": {"drafter": "eagle3", "lookup_min": 1},
    },
    "separate": {
        "method": "draft",
        "extra_methods": ["hierarchical", "eagle", "eagle3"],
        "draft": {"model": "separate", "quantization": "none"},
        "hierarchical": {"level1": "draft_truncated", "level1_num_layers": 1, "tau2": 10.0},
        "window": {"policy": "entropy", "tau": 3.0},
        "eagle": {"tree_top_k": 2},
        "eagle3": {"tree_top_k": 2},
    },
}
CASES = {
    "ngram": ("self", "ngram"),
    "draft-self-int8": ("self", "draft"),
    "layerskip": ("self", "layerskip"),
    "hierarchical-ngram": ("self", "hierarchical"),
    "medusa-tree": ("self", "medusa"),
    "hydra-tree": ("self", "hydra"),
    "eagle": ("self", "eagle"),
    "eagle3": ("self", "eagle3"),
    "kangaroo": ("self", "kangaroo"),
    "hybrid": ("self", "hybrid"),
    "draft-separate": ("separate", "draft"),
    "eagle-tree": ("separate", "eagle"),
    "eagle3-tree": ("separate", "eagle3"),
    "hierarchical-draft_truncated": ("separate", "hierarchical"),
}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_model(
        tmp_path_factory.mktemp("small-vocab") / "llama", seed=3, vocab_size=VOCAB
    )


@pytest.fixture(scope="module")
def engines(target_dir, tmp_path_factory) -> dict[str, LLM]:
    draft_dir = save_perturbed_copy(
        target_dir, tmp_path_factory.mktemp("small-draft") / "llama", 0.01
    )
    # Random heads: trees whose siblings the target often rejects, so every rule is exercised.
    trained = {
        kind: save_heads_drafter(target_dir, tmp_path_factory.mktemp(kind) / "d", kind, scale=0.05)
        for kind in ("medusa", "hydra")
    }
    trained["eagle"] = save_eagle_drafter(target_dir, tmp_path_factory.mktemp("eagle") / "d")
    trained["eagle3"] = save_eagle3_drafter(target_dir, tmp_path_factory.mktemp("eagle3") / "d")
    trained["kangaroo"] = save_kangaroo_drafter(target_dir, tmp_path_factory.mktemp("kg") / "d")
    built = {}
    for name, spec in DECODERS.items():
        for kind, drafter in trained.items():
            if kind in spec.get("extra_methods", []):
                spec = {**spec, kind: {**spec.get(kind, {}), "drafter": str(drafter)}}
        draft = spec["draft"]
        if draft["model"] == "separate":
            spec = {**spec, "draft": {**draft, "model": str(draft_dir)}}
        built[name] = LLM(
            model=str(target_dir),
            decoder={
                **spec,
                "num_speculative_tokens": 2,
                "draft_policy": "fixed",  # every step drafts: sampling is checked on drafts
                "prompt_lookup_min": 1,
                "prompt_lookup_max": 3,
            },
            kv_cache={"num_blocks": 2048},
            # Room for hundreds of continuations at once, and budget left for all their drafts.
            scheduler={"max_num_seqs": 512, "max_num_batched_tokens": 16384},
        )
    return built


@pytest.fixture(scope="module")
def exact(engines) -> dict[tuple[str, str], tuple[torch.Tensor, ...]]:
    """The exact marginals by (prompt, params name): PROMPT's, and HALF_PROMPT's as well."""
    return {
        (prompt_name, name): exact_marginals(engines["self"].engine, prompt, p)
        for prompt_name, prompt in (("every token", PROMPT), ("half", HALF_PROMPT))
        for name, p in PARAMS.items()
    }


class _Row:
    def __init__(self, params: SamplingParams, prompt: list[int], output: list[int]):
        self.sampling_params, self.prompt_token_ids, self.output_token_ids = params, prompt, output


def exact_marginals(engine, prompt: list[int], params: SamplingParams):
    """The target's exact distributions of output tokens 1, 2 and 3, each marginalised over
    the tokens before it, from the target model alone: it scores the prompt, then every
    two-token continuation (a, b) in one pass, in a cache of 2-token blocks where the prompt's
    blocks are shared and each continuation has one block of its own."""
    model = engine.model
    arch, vocab = model.arch, model.arch.vocab_size
    assert len(prompt) % 2 == 0
    shared = list(range(len(prompt) // 2))
    pairs = [(a, b) for a in range(vocab) for b in range(vocab)]
    cache = KVCache(
        arch.num_layers,
        len(shared) + len(pairs),
        2,
        arch.num_kv_heads,
        arch.head_dim,
        model.dtype,
        "cpu",
    )
    runner = ModelRunner(model, cache, "cpu")
    after_prompt = runner.run([ForwardItem(prompt, 0, shared, 1)])
    items = [
        ForwardItem([a, b], len(prompt), [*shared, len(shared) + i], 2)
        for i, (a, b) in enumerate(pairs)
    ]
    after_pairs = runner.run(items).view(vocab, vocab, 2, vocab)

    def probs(logits, outputs):
        rows = [_Row(params, prompt, output) for output in outputs]
        return probabilities(process_logits(logits, rows, engine.eos_token_ids)).double()

    first = probs(after_prompt, [[]])[0]
    second = probs(after_pairs[:, 0, 0], [[a] for a in range(vocab)])  # [a, next]
    third = probs(after_pairs[:, :, 1].reshape(-1, vocab), pairs).view(vocab, vocab, vocab)
    return first, first @ second, torch.einsum("a,ab,abc->c", first, second, third)


def sample_continuations(
    engine, method: str, requests: list[SamplingParams], monkeypatch, prompt=PROMPT
):
    """Run ``requests`` (on ``prompt``) with ``method``; returns the output token ids, one row
    per continuation, and how many proposals carried the drafter's distributions q."""
    decoder = engine.speculator.decoders[method]
    with_q = []

    def propose(seqs, num_drafts, _inner=decoder.propose):
        proposals = _inner(seqs, num_drafts)
        with_q.extend(p.draft_probs is not None for p in proposals.values())
        return proposals

    monkeypatch.setattr(decoder, "propose", propose)
    for i, params in enumerate(requests):
        engine.add_request(f"{method}-{i}", prompt, params, SpeculativeOptions(method))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for out in engine.step() if out.finished for o in out.outputs]
    assert engine.block_manager.num_used_blocks == 0
    return torch.tensor([o.token_ids for o in outputs]), sum(with_q)


def check_distributions(tokens: torch.Tensor, marginals) -> None:
    for position, exact_p in enumerate(marginals):
        counts = torch.bincount(tokens[:, position], minlength=VOCAB)
        p_value = chi_square_p_value(counts, exact_p)
        assert p_value > LEVEL, f"token {position + 1}: chi-square p = {p_value:.3g}"


def run_case(engines, exact, case, params_name, requests, monkeypatch) -> None:
    engine_name, method = CASES[case]
    engine = engines[engine_name].engine
    stats = engine.speculator.stats_by_decoder[method]
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    prompt_name, prompt = ("half", HALF_PROMPT) if case == "hybrid" else ("every token", PROMPT)
    tokens, num_with_q = sample_continuations(engine, method, requests, monkeypatch, prompt)
    assert tokens.shape == (DRAWS, 4)
    check_distributions(tokens, exact[prompt_name, params_name])
    drafts = stats.num_drafts - before[0]
    draft_tokens = stats.num_draft_tokens - before[1]
    accepted = stats.num_accepted_tokens - before[2]
    # Every continuation's second token was verified against drafts, and the drafts were both
    # accepted and rejected (so both the acceptance test and the residual were sampled).
    assert drafts >= DRAWS and 0 < accepted < draft_tokens
    # A model drafter samples its drafts and hands q to the rejection sampler; prompt lookup's,
    # the trained heads' and EAGLE-2 trees' drafts are deterministic (q one-hot, passed as None).
    deterministic = case in ("ngram", "medusa-tree", "hydra-tree", "eagle-tree", "eagle3-tree")
    if case == "hybrid":  # both sources drafted: the lookup's drafts one-hot, EAGLE-3's with q
        assert 0 < drafts - num_with_q < num_with_q
    else:
        assert num_with_q == (0 if deterministic else drafts)


@pytest.mark.parametrize("params_name", list(PARAMS))
@pytest.mark.parametrize("case", list(CASES))
def test_continuations_of_one_request_follow_the_target(
    engines, exact, case, params_name, monkeypatch
):
    params = PARAMS[params_name]
    request = SamplingParams(
        **{**params.__dict__, "n": DRAWS, "max_tokens": 4, "ignore_eos": True, "seed": 1}
    )
    run_case(engines, exact, case, params_name, [request], monkeypatch)


@pytest.mark.parametrize("case", list(CASES))
def test_separately_seeded_requests_follow_the_target(engines, exact, case, monkeypatch):
    """One continuation per request, each request with its own seed."""
    name = "penalties-logit_bias"
    params = PARAMS[name]
    requests = [
        SamplingParams(
            **{**params.__dict__, "max_tokens": 4, "ignore_eos": True, "seed": 20_000 + i}
        )
        for i in range(DRAWS)
    ]
    run_case(engines, exact, case, name, requests, monkeypatch)


def test_continuations_of_a_seeded_request_draft_independently(engines, monkeypatch):
    """Continuations i and j of a request seeded s sample with seeds s + i and s + j; their
    drafts must be independent draws as well. Continuations that sampled the same first token
    have the same q for their first draft, so identical drafts across all of them mean one
    shared random stream."""
    engine = engines["self"].engine
    decoder = engine.speculator.decoders["draft"]
    first_drafts: dict[int, list[int]] = {}

    def propose(seqs, num_drafts, _inner=decoder.propose):
        proposals = _inner(seqs, num_drafts)
        for seq, proposal in proposals.items():
            if len(seq.output_token_ids) == 1:
                first_drafts.setdefault(seq.output_token_ids[0], []).append(proposal.token_ids[0])
        return proposals

    monkeypatch.setattr(decoder, "propose", propose)
    params = SamplingParams(temperature=1.0, n=200, max_tokens=3, ignore_eos=True, seed=1)
    engine.add_request("independent", PROMPT, params, SpeculativeOptions("draft"))
    while engine.has_unfinished_requests():
        engine.step()
    largest = max(first_drafts.values(), key=len)
    assert len(largest) >= 10
    assert len(set(largest)) > 1, f"{len(largest)} continuations all drafted {largest[0]}"


def test_draft_lengths_switching_mid_request_keep_sampling_exact(engines, exact, monkeypatch):
    # A goodput policy told that steps cost the same whatever their size: one continuation
    # tries each length first, then all move up to it (0, then 1, then 2), and one tries one
    # more every other step: the continuations' draft lengths change from step to step.
    engine = engines["self"].engine
    policy = GoodputPolicy(explore_every=2)
    monkeypatch.setattr(policy.cost, "predict", lambda *args, **kwargs: 0.01)
    # ... and that drafting is free: measured drafting time differs between machines, and on
    # a slow one it kept every continuation at length 0 (the lengths must change, whatever CPU).
    observe_draft = policy.observe_draft
    monkeypatch.setattr(
        policy,
        "observe_draft",
        lambda decoder, depth, num_seqs, seconds: observe_draft(decoder, depth, num_seqs, 0.0),
    )
    monkeypatch.setattr(engine.speculator, "policy", policy)
    params = PARAMS["penalties-logit_bias"]
    request = SamplingParams(
        **{**params.__dict__, "n": DRAWS, "max_tokens": 4, "ignore_eos": True, "seed": 2}
    )
    tokens, _ = sample_continuations(engine, "draft", [request], monkeypatch)
    check_distributions(tokens, exact["every token", "penalties-logit_bias"])
    assert sum(1 for count in policy.chosen["draft"].values() if count) >= 2, policy.chosen
