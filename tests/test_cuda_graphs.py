"""The fixed-shape steps that CUDA graphs replay compute what the eager path does.

A graph replays ``run_padded`` over a step laid out at its bucket's shape; here that padded step
runs eagerly on the CPU (no GPU needed) against ``ModelRunner``'s own path: decode steps, draft
chains of different lengths, token trees and hidden-state options give the same logits and
hidden states, write the same K/V, and touch nothing but the scratch block besides.
"""

from __future__ import annotations

import pytest
import torch

from engine.cuda_graphs import (
    MAX_GRAPH_QUERIES,
    GraphKey,
    graph_key,
    plan_padded_step,
    run_padded,
)
from engine.kv_cache import KVCache
from engine.model_runner import ForwardItem, ModelRunner, _real_rows_of
from engine.models.loader import load_model

BLOCK = 4


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    model, _ = load_model(tiny_model_dir, torch.float32, "cpu", None)
    return model


def cache_for(model) -> KVCache:
    arch = model.arch
    return KVCache(
        arch.num_layers, 32, BLOCK, arch.num_kv_heads, arch.head_dim, torch.float32, "cpu",
        scratch_blocks=1,
    )  # fmt: skip


def prefilled(model, contexts: list[list[int]]) -> tuple[KVCache, list[list[int]]]:
    """A cache holding ``contexts`` (disjoint block tables, 6 blocks each) and the tables."""
    cache = cache_for(model)
    tables = [list(range(6 * i, 6 * i + 6)) for i in range(len(contexts))]
    runner = ModelRunner(model, cache, "cpu")
    runner.run([ForwardItem(c, 0, t, 1) for c, t in zip(contexts, tables, strict=True)])
    return cache, tables


CONTEXTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18, 19, 20, 21, 22]]


def steps(tables):
    decode = [
        ForwardItem([30 + i], len(c), t, 1)
        for i, (c, t) in enumerate(zip(CONTEXTS, tables, strict=True))
    ]
    chains = [
        ForwardItem([40, 41, 42], len(CONTEXTS[0]), tables[0], 3),
        ForwardItem([43], len(CONTEXTS[1]), tables[1], 1),
        ForwardItem([44, 45], len(CONTEXTS[2]), tables[2], 2),
    ]
    tree = [
        ForwardItem([50, 51, 52, 53], len(CONTEXTS[0]), tables[0], 4, tree_parents=[-1, 0, 0, 1]),
        ForwardItem([54], len(CONTEXTS[1]), tables[1], 1),
        ForwardItem([55, 56], len(CONTEXTS[2]), tables[2], 2, tree_parents=[-1, -1]),
    ]
    return {"decode": decode, "chains": chains, "tree": tree}


@pytest.mark.parametrize("kind", ["decode", "chains", "tree"])
@pytest.mark.parametrize(
    "options",
    [{}, {"hidden_layer": 1, "all_hidden": True}, {"hidden_layer": 2}, {"layer_ids": [0, 2]}],
)
def test_padded_step_matches_the_eager_step(model, kind, options):
    eager_cache, tables = prefilled(model, CONTEXTS)
    padded_cache, _ = prefilled(model, CONTEXTS)
    items = steps(tables)[kind]
    expected = ModelRunner(model, eager_cache, "cpu").forward(items, **options)

    key = graph_key(items, options)
    assert key.batch == 4 and key.keys == 128  # one padding sequence, keys padded to 128
    step = plan_padded_step(items, key, BLOCK, padded_cache.scratch_slot)
    with torch.inference_mode():
        out = run_padded(model, padded_cache, step, model.arch.head_dim**-0.5, dict(key.options))
    got = _real_rows_of(items, out, step.real_rows, options)

    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
    if "hidden_layer" in options:
        torch.testing.assert_close(got.hidden_states, expected.hidden_states, rtol=1e-5, atol=1e-5)
    real = slice(0, padded_cache.scratch_slot)  # everything but the scratch block
    torch.testing.assert_close(padded_cache.storage[:, :, real], eager_cache.storage[:, :, real])


def test_steps_that_do_not_fit_a_bucket_run_eagerly(tiny_model_dir):
    long = ForwardItem(list(range(MAX_GRAPH_QUERIES + 1)), 0, [0, 1, 2, 3, 4], 1)
    assert graph_key([long], {}) is None
    with_prompt_logits = ForwardItem([1, 2], 3, [0, 1], 1, extra_logit_rows=[0])
    assert graph_key([with_prompt_logits], {}) is None
    assert graph_key([], {}) is None


def test_buckets_round_up_batch_and_keys():
    items = [ForwardItem([1], 300, list(range(80)), 1) for _ in range(5)]
    assert graph_key(items, {"skip_mlp": frozenset({3, 1})}) == GraphKey(
        8, 1, 512, (("skip_mlp", (1, 3)),)
    )


def test_padding_rows_write_only_the_scratch_slot(model):
    cache, tables = prefilled(model, CONTEXTS)
    items = steps(tables)["chains"]
    key = graph_key(items, {})
    step = plan_padded_step(items, key, BLOCK, cache.scratch_slot)
    real = set(step.real_rows.tolist())
    padding = [r for r in range(key.batch * key.queries) if r not in real]
    assert padding and all(step.slot_mapping[r] == cache.scratch_slot for r in padding)
    assert step.mask[key.batch - 1, 0].sum() == key.queries  # a padding sequence: one key per row


class EagerPaddedSteps:
    """``CudaGraphs``' stand-in on the CPU: the padded step a graph records, run eagerly."""

    def __init__(self, model, cache: KVCache):
        self.model, self.cache = model, cache

    def run(self, items, options):
        key = graph_key(items, options)
        if key is None:
            return None
        step = plan_padded_step(items, key, BLOCK, self.cache.scratch_slot)
        scale = self.model.arch.head_dim**-0.5
        return run_padded(self.model, self.cache, step, scale, dict(key.options)), step.real_rows


@pytest.mark.parametrize("options", [{}, {"hidden_layer": 1, "all_hidden": True}])
def test_a_step_mixing_prefill_and_decode_splits_into_graph_and_eager_passes(model, options):
    eager_cache, tables = prefilled(model, CONTEXTS)
    split_cache, _ = prefilled(model, CONTEXTS)
    items = [
        ForwardItem([30], len(CONTEXTS[0]), tables[0], 1),
        ForwardItem(list(range(60, 60 + MAX_GRAPH_QUERIES + 3)), 0, list(range(24, 30)), 1),
        ForwardItem([44, 45], len(CONTEXTS[2]), tables[2], 2),
        # A prompt chunk that wants prompt logprobs: its extra rows keep it eager.
        ForwardItem([70, 71, 72], 0, [30, 31], 0, extra_logit_rows=[0, 1]),
    ]
    plain = ModelRunner(model, eager_cache, "cpu")
    expected = plain.forward(items, **options)
    split = ModelRunner(model, split_cache, "cpu")
    split.graphs = EagerPaddedSteps(model, split_cache)
    got = split.forward(items, **options)

    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split.extra_logits, plain.extra_logits, rtol=1e-5, atol=1e-5)
    if options:
        torch.testing.assert_close(got.hidden_states, expected.hidden_states, rtol=1e-5, atol=1e-5)
    real = slice(0, split_cache.scratch_slot)
    torch.testing.assert_close(split_cache.storage[:, :, real], eager_cache.storage[:, :, real])
