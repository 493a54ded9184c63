"""CUDA graphs' buckets cover every decode and verification step a drafting engine runs, so
no speculative step falls back to eager execution on a GPU. The bucket choice and the start-up
capture plan are plain Python: here real decoders run on the CPU (drafting chains and trees,
fixed and goodput-chosen k, a request's own k) and every step they take is checked against
them."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.cuda_graphs import (
    MAX_GRAPH_QUERIES,
    MAX_GRAPH_ROWS,
    MAX_GRAPHS,
    QUERY_BUCKETS,
    capture_plan,
    graph_key,
    query_bucket,
)
from engine.model_runner import ForwardItem
from engine.speculative_options import MAX_SPECULATIVE_TOKENS, SpeculativeOptions
from tests.tiny_models import save_eagle_drafter

pytestmark = pytest.mark.usefixtures("single_torch_thread")

PROMPTS = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 9 + [14], [20 + i % 7 for i in range(40)]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_every_width_up_to_the_largest_k_has_a_bucket():
    assert QUERY_BUCKETS[0] == 1 and MAX_GRAPH_QUERIES == 1 + MAX_SPECULATIVE_TOKENS
    for width in range(1, MAX_GRAPH_QUERIES + 1):
        bucket = query_bucket(width)
        assert bucket >= width and bucket in QUERY_BUCKETS
    assert query_bucket(MAX_GRAPH_QUERIES + 1) is None
    # Exact buckets where most configurations draft (k <= 5): no padded rows there.
    assert all(query_bucket(width) == width for width in range(1, 7))


def test_the_plan_covers_its_widths_and_fits_the_graph_limit():
    plan = capture_plan(64, 5, [{}, {"hidden_layer": 29, "all_hidden": True}])
    assert len(plan) <= MAX_GRAPHS and len(set(plan)) == len(plan)
    assert {key.queries for key in plan} == {1, 2, 3, 4, 5}
    assert {key.batch for key in plan} == {1, 2, 4, 8, 16, 32, 64}
    assert all(key.batch * key.queries <= MAX_GRAPH_ROWS for key in plan)
    assert {key.queries for key in capture_plan(8, 1, [{}])} == {1}  # plain decoding
    wide = capture_plan(256, 17, [{}])
    assert max(key.queries for key in wide) == MAX_GRAPH_QUERIES
    assert all(key.batch * key.queries <= MAX_GRAPH_ROWS for key in wide)


def _recorded(llm: LLM, speculative=None, prompts=PROMPTS) -> list[tuple[list[ForwardItem], dict]]:
    """Every target step of a generation: its items and model options."""
    runner, steps = llm.engine.runner, []
    original = runner.forward

    def forward(items, **options):
        steps.append((list(items), dict(options)))
        return original(items, **options)

    runner.forward = forward
    try:
        llm.generate(prompts, GREEDY, speculative=speculative)
    finally:
        runner.forward = original
    return steps


def _short_steps(steps, widest: int):
    """The steps of decode and verification rows only (prefill chunks run eagerly by design)."""
    return [
        (items, options)
        for items, options in steps
        if all(item.num_cached > 0 and len(item.token_ids) <= widest for item in items)
    ]


@pytest.fixture(scope="module")
def eagle_dir(tiny_model_dir, tmp_path_factory):
    return save_eagle_drafter(tiny_model_dir, tmp_path_factory.mktemp("eagle") / "drafter")


DECODERS = {
    "ngram-chain-fixed": {"method": "ngram", "prompt_lookup_min": 1, "draft_policy": "fixed"},
    "ngram-tree-goodput": {
        "method": "ngram",
        "prompt_lookup_min": 1,
        "prompt_lookup_candidates": 3,
    },  # fmt: skip
    "draft-goodput": {"method": "draft", "draft": {"model": "self", "quantization": "int8"}},
    "eagle-hidden-states": {"method": "eagle", "draft_policy": "fixed"},
}


@pytest.mark.parametrize("name", DECODERS)
def test_every_decode_and_verification_step_is_in_the_start_up_plan(
    tiny_model_dir, eagle_dir, name
):
    decoder = dict(DECODERS[name], num_speculative_tokens=3)
    if decoder["method"] == "eagle":
        decoder["eagle"] = {"drafter": str(eagle_dir)}
    llm = LLM(model=str(tiny_model_dir), decoder=decoder, kv_cache={"num_blocks": 256})
    width, options = llm.engine.graph_widths_and_options()
    assert width == 4
    plan = set(capture_plan(llm.engine.config.scheduler.max_num_seqs, width, options))
    steps = _short_steps(_recorded(llm), width)
    assert steps and max(len(item.token_ids) for items, _ in steps for item in items) > 1
    for items, step_options in steps:
        key = graph_key(items, step_options)
        assert key is not None, f"would run eagerly: {[len(i.token_ids) for i in items]}"
        assert key in plan, f"not captured at start-up: {key}"


def test_a_request_asking_for_more_drafts_stays_inside_the_plan(tiny_model_dir):
    """A request's own k may lower the configured k, never raise it (its drafts come out of
    the step budget every sequence shares), so the start-up plan holds its steps too."""
    decoder = {"method": "ngram", "prompt_lookup_min": 1, "draft_policy": "fixed"}
    llm = LLM(model=str(tiny_model_dir), decoder=decoder, kv_cache={"num_blocks": 256})
    width, options = llm.engine.graph_widths_and_options()
    plan = set(capture_plan(llm.engine.config.scheduler.max_num_seqs, width, options))
    own = SpeculativeOptions("ngram", num_speculative_tokens=MAX_SPECULATIVE_TOKENS)
    # A long earlier occurrence of the prompt's end: prompt lookup could draft 16 from it.
    prompt = list(range(30, 70)) * 2 + list(range(30, 36))
    steps = _short_steps(_recorded(llm, own, [prompt]), MAX_GRAPH_QUERIES)
    widths = {len(item.token_ids) for items, _ in steps for item in items}
    assert max(widths) == width
    assert all(graph_key(items, options) in plan for items, options in steps)
