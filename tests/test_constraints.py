"""Constrained decoding in the engine: the matcher follows any history (drafts, rollbacks), a
tree node is masked after the path to it, greedy constrained output is identical with and
without speculation (every decoder family, window policy and the gate), a drafter proposes only
what the constraint allows, sampled JSON validates against its schema with drafts and trees, a
batch mixing constraints equals each request alone, and sampled constrained output follows the
target's distribution masked and renormalised."""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter

import jsonschema
import pytest
import torch

from engine import LLM, ConstraintSpec, SamplingParams
from engine.decoders import SpeculativeOptions
from engine.rejection_sampler import DraftRun, RejectionSampler, position_row
from tests.stats import chi_square_p_value
from tests.tiny_models import (
    save_eagle_drafter,
    save_heads_drafter,
    save_kangaroo_drafter,
    save_perturbed_copy,
)

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
JSON_PROMPTS = ["Write JSON:", "Another one", "x y z"]

# Engines for the speculative tests, each loading several decoders (a request picks one with
# SpeculativeOptions); a window policy and the gate belong to an engine, so each has its own.
# The tiny chat model is nearly flat over its 49,152 tokens: a draft's top-1 probability is
# ~0.001-0.005 and its entropy ~10.05-10.11 nats, the target's probability for the token it
# emits ~1e-6-1e-3. The thresholds below sit inside those ranges, so that windows both stop
# early and draft on, and the gate both holds sequences back and lets them draft.
ENGINES = {
    "separate": {  # the draft model: the tiny model plus noise, with its own KV cache
        "method": "draft",
        "extra_methods": ["ngram", "medusa", "hydra"],
        "draft": {"model": "separate"},
    },
    # Prompt lookup from 1-grams: JSON repeats single tokens (quotes, whitespace) followed by
    # different ones, so the matches' continuations branch into trees.
    "tree": {"method": "ngram", "prompt_lookup_candidates": 4, "prompt_lookup_min": 1},
    "self-int8": {
        "method": "draft",
        "extra_methods": ["layerskip", "hierarchical", "eagle", "kangaroo"],
        "draft": {"model": "self", "quantization": "int8"},
        "layerskip": {"exit_layer": 0},
        "hierarchical": {"level1": "draft_truncated", "level1_num_layers": 1, "tau2": 12.0},
    },
    "adaptive-exit": {
        "method": "layerskip",
        "extra_methods": ["hierarchical"],
        "draft": {"model": "self", "quantization": "bfloat16"},
        "layerskip": {"skip_attention": [1], "skip_mlp": [0]},
        "hierarchical": {"level1": "ngram", "tau2": 12.0},
        "window": {"policy": "adaptive_exit", "gamma": 0.0015, "step": 0.0001},
    },
    "entropy-gated": {
        "method": "draft",
        "draft": {"model": "self", "quantization": "none", "num_layers": 1},
        "window": {"policy": "entropy", "tau": 10.08},
        "gate": {"min_target_prob": 1e-4},
    },
}
# (engine, decoder): plain decoding, a model drafter's chains, prompt lookup's token trees.
PLAIN_CHAIN_TREE = [
    pytest.param(None, None, id="plain"),
    pytest.param("separate", "draft", id="draft"),
    pytest.param("tree", "ngram", id="ngram-tree"),
]
# Trained drafters, written for the tiny chat model on first use.
DRAFTER_FILES = {
    "medusa": lambda model, path: save_heads_drafter(model, path, "medusa"),
    "hydra": lambda model, path: save_heads_drafter(model, path, "hydra"),
    "eagle": save_eagle_drafter,
    "kangaroo": save_kangaroo_drafter,
}


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


@pytest.fixture(scope="module")
def speculative(tiny_chat_model_dir, chat_draft_dir, tmp_path_factory):
    """``speculative(name)``: the LLM of ``ENGINES[name]``, built on first use, k = 4 drafts
    every step (a fixed draft policy: these tests are about what drafting does)."""
    engines: dict[str, LLM] = {}
    drafters = tmp_path_factory.mktemp("drafters")

    def get(name: str) -> LLM:
        if name not in engines:
            config = {**ENGINES[name], "draft_policy": "fixed", "num_speculative_tokens": 4}
            if config.get("draft") == {"model": "separate"}:
                config["draft"] = {"model": str(chat_draft_dir)}
            for method in [config["method"], *config.get("extra_methods", [])]:
                if method in DRAFTER_FILES:
                    path = DRAFTER_FILES[method](tiny_chat_model_dir, drafters / method)
                    config[method] = {"drafter": str(path)}
            engines[name] = LLM(
                model=str(tiny_chat_model_dir), decoder=config, kv_cache={"num_blocks": 256}
            )
        return engines[name]

    return get


def record_proposals(llm: LLM, method: str, monkeypatch) -> list:
    """The proposals ``llm``'s decoder ``method`` makes from now on (a spy on ``propose``)."""
    decoder = llm.engine.speculator.decoders[method]
    propose, proposals = decoder.propose, []

    def recorded(seqs, num_drafts):
        found = propose(seqs, num_drafts)
        proposals.extend(found.values())
        return found

    monkeypatch.setattr(decoder, "propose", recorded)
    return proposals


def test_engine_package_exports_constraint_spec():
    from engine.constraints import ConstraintSpec as Defined

    assert ConstraintSpec is Defined


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


def test_a_tree_node_is_masked_after_the_path_to_it(llm):
    """The target's row at a tree node is masked after the drafts on the path to that node,
    not after the drafts listed before it: "blue" (the root's second child) then the end is
    accepted, though "red" (its elder sibling) followed by "blue" breaks the choice."""
    spec = ConstraintSpec("choice", ["red", "blue"])
    red, blue = (llm.tokenizer.encode(w, add_special_tokens=False)[0] for w in ("red", "blue"))
    eos = sorted(llm.engine.eos_token_ids)[0]
    params = SamplingParams(temperature=0, constraint=spec)
    params = params.for_sequence(llm.engine.constraints.state(spec))
    run = DraftRun(position_row(params, [1], [], []), [red, blue, eos], parents=[-1, -1, 1])
    # Rows: after the prompt, after red, after blue, after blue and the end. The target
    # prefers blue first; then its raw logits favour "red" again, which only the mask (the
    # choice is complete: nothing but the end may follow) takes away.
    logits = torch.zeros(4, llm.engine.constraints.vocab_size)
    logits[0, red], logits[0, blue] = 1.0, 2.0
    logits[1:, red] = 5.0
    [verified] = RejectionSampler(llm.engine.eos_token_ids)(logits, [run])
    assert verified.path == [1, 2]
    assert [t.token_id for t in verified.tokens[:2]] == [blue, eos]


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


@pytest.mark.parametrize(("engine", "method"), PLAIN_CHAIN_TREE)
def test_sampled_json_validates_against_its_schema(llm, speculative, engine, method, monkeypatch):
    """Every sampled document is complete and valid, decoded plainly, with a model drafter's
    chains and with prompt lookup's token trees (those must really be drafted)."""
    target = llm if engine is None else speculative(engine)
    options = None if method is None else SpeculativeOptions(method)
    proposals = [] if method is None else record_proposals(target, method, monkeypatch)
    outs = target.generate(JSON_PROMPTS, _json_params(temperature=1.0, seed=7, n=4), options)
    for out in outs:
        for choice in out.outputs:
            assert choice.finish_reason == "stop", choice.text
            jsonschema.validate(json.loads(choice.text), SCHEMA)
    if method is not None:
        assert proposals, "nothing was drafted"
    if engine == "tree":
        assert any(p.parents is not None for p in proposals), "no tree was drafted"


# (engine, decoder): every decoder family, layer skipping both ways, both kinds of the
# hierarchy's level 1, a separate and a self (int8) draft, both adaptive windows and the gate.
GREEDY_CASES = [
    ("separate", "draft"),
    ("separate", "ngram"),
    ("separate", "medusa"),
    ("separate", "hydra"),
    ("tree", "ngram"),
    ("self-int8", "draft"),
    ("self-int8", "layerskip"),  # early exit
    ("self-int8", "hierarchical"),  # level 1: the draft's first layer
    ("self-int8", "eagle"),
    ("self-int8", "kangaroo"),
    ("adaptive-exit", "layerskip"),  # skipped sublayers
    ("adaptive-exit", "hierarchical"),  # level 1: prompt lookup
    ("entropy-gated", "draft"),
]


@pytest.fixture(scope="module")
def greedy_json(llm) -> list[list[int]]:
    """The greedy JSON documents of JSON_PROMPTS, decoded plainly."""
    return [o.outputs[0].token_ids for o in llm.generate(JSON_PROMPTS, _json_params(temperature=0))]


@pytest.mark.parametrize(
    ("engine", "method"), GREEDY_CASES, ids=[":".join(c) for c in GREEDY_CASES]
)
def test_greedy_constrained_output_is_identical_with_speculation(
    engine, method, speculative, greedy_json, monkeypatch
):
    spec_llm = speculative(engine)
    proposals = record_proposals(spec_llm, method, monkeypatch)
    stats = spec_llm.engine.speculator.stats_by_decoder[method]
    gate = spec_llm.engine.speculator.gate
    runs, drafts, gated = stats.num_drafts, stats.num_draft_tokens, gate.num_gated
    outs = spec_llm.generate(JSON_PROMPTS, _json_params(temperature=0), SpeculativeOptions(method))
    assert [o.outputs[0].token_ids for o in outs] == greedy_json
    runs, drafts = stats.num_drafts - runs, stats.num_draft_tokens - drafts
    assert drafts > 0, "it never drafted"
    if ENGINES[engine].get("window"):
        # The window both stopped short of k and let drafting go on.
        assert runs < drafts < 4 * runs, (runs, drafts)
    if ENGINES[engine].get("gate"):
        assert gate.num_gated > gated
    if engine == "tree":
        assert any(p.parents is not None for p in proposals), "no tree was drafted"


def test_the_drafter_proposes_only_what_the_constraint_allows(speculative, monkeypatch):
    """The drafter's q is masked as the target's p is: each draft token is allowed after the
    output and the drafts before it, and a sampled row's q has no mass outside the allowed
    tokens. (With q unmasked the output would still be right, its bad drafts rejected: only
    acceptance would suffer, so only this test shows it.)"""
    spec_llm = speculative("separate")
    drafter = spec_llm.engine.speculator.decoders["draft"].drafter
    draft = drafter.draft
    proposed = []  # (the output the drafts continue, the proposal, whether sampled)

    def recorded(seqs, num_drafts, prefixes=None):
        outputs = {s: list(s.output_token_ids) for s in seqs}
        proposals = draft(seqs, num_drafts, prefixes)
        for s, proposal in proposals.items():
            proposed.append((outputs[s], proposal, not s.sampling_params.greedy))
        return proposals

    monkeypatch.setattr(drafter, "draft", recorded)
    spec = ConstraintSpec("json_schema", SCHEMA)
    params = [
        SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=60, constraint=spec),
        SamplingParams(temperature=0, max_tokens=60, constraint=spec),
    ]
    spec_llm.generate(["Write JSON:", "Another one"], params)
    assert {sampled for _, _, sampled in proposed} == {True, False}
    checker = spec_llm.engine.constraints.state(spec)
    for output, proposal, sampled in proposed:
        for j, token in enumerate(proposal.token_ids):
            allowed = checker.allowed(output + proposal.token_ids[:j])
            assert allowed is not None and allowed[token], (output, proposal.token_ids, j)
            if sampled:
                assert proposal.draft_probs[j][~allowed].sum() == 0


@pytest.mark.parametrize(("engine", "method"), PLAIN_CHAIN_TREE)
def test_a_batch_mixing_constraints_equals_each_request_alone(
    llm, speculative, engine, method, monkeypatch
):
    """JSON, no constraint, choices and banned words (tempted by a logit bias, so that rewinds
    happen) in one greedy batch, plain and with drafts: each output is the request's own."""
    cat = llm.tokenizer.encode(" cat", add_special_tokens=False)[0]
    choice = ConstraintSpec("choice", CHOICES)
    tempted = {"logit_bias": {cat: 9.0}, "banned_words": ["cat"]}
    requests = [
        ("Write JSON:", _json_params(temperature=0)),
        ("Tell me", SamplingParams(temperature=0, max_tokens=24)),
        ("Pick:", SamplingParams(temperature=0, max_tokens=8, constraint=choice)),
        ("Once", SamplingParams(temperature=0, max_tokens=24, **tempted)),
    ]
    alone = [llm.generate([p], params)[0].outputs[0] for p, params in requests]
    assert alone[2].text in CHOICES
    assert not re.search(r"(?<!\w)cat(?!\w)", alone[3].text, re.IGNORECASE)
    target = llm if engine is None else speculative(engine)
    proposals = [] if method is None else record_proposals(target, method, monkeypatch)
    rewinds = target.engine.num_rewinds
    options = None if method is None else SpeculativeOptions(method)
    outs = target.generate([p for p, _ in requests], [params for _, params in requests], options)
    assert [o.outputs[0].token_ids for o in outs] == [a.token_ids for a in alone]
    assert target.engine.num_rewinds > rewinds  # the banned word was met, and removed
    if method is not None:
        assert proposals, "nothing was drafted"


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


def test_sampled_constrained_output_follows_the_masked_target(tiny_chat_model_dir, speculative):
    """With a draft model proposing (its q masked too), 2,000 samples against the exact
    distribution of the masked-and-renormalised target."""
    spec_llm = speculative("separate")
    stats = spec_llm.engine.speculator.stats_by_decoder["draft"]
    drafts = stats.num_draft_tokens
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
    assert stats.num_draft_tokens > drafts
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
