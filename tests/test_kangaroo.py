"""Kangaroo: the draft model (the target's first layers and the adapter) equals the adapter's
training form, greedy identity through the engine (batched, preempted, aborted), the second
early exit, and `specserve train kangaroo` on a tiny model (loss falls, a checkpoint resumes,
the drafter loads). Sampled exactness is in tests/test_decoders_sampling.py."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.decoders.drafter_files import TrainedDrafter
from engine.decoders.kangaroo import KangarooAdapter
from engine.model_runner import ForwardItem
from tests.decoder_checks import (
    check_greedy_identity_batched_preempted_aborted,
    first_draft_after_a_prefix_hit,
    first_draft_sharing_a_prefix,
)
from tests.tiny_models import save_kangaroo_drafter
from tooling.training.self_distillation import sequence_features
from tooling.training.train_kangaroo import KangarooTrainOptions, run_train_kangaroo

pytestmark = pytest.mark.usefixtures("single_torch_thread")

PROMPTS = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 9 + [14], [3] * 12, [40 + i % 9 for i in range(30)]]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def drafter_dir(tiny_model_dir, tmp_path_factory):
    return save_kangaroo_drafter(tiny_model_dir, tmp_path_factory.mktemp("kangaroo") / "d")


def kangaroo_llm(model_dir, drafter, quantization="int8", threshold=0.0, **overrides) -> LLM:
    spec = {"drafter": str(drafter), "quantization": quantization, "exit_threshold": threshold}
    decoder = {"method": "kangaroo", "kangaroo": spec, "num_speculative_tokens": 4,
               "draft_policy": "fixed"}  # fmt: skip
    return LLM(model=str(model_dir), decoder=decoder, **overrides)


def test_draft_model_equals_the_adapters_training_form(tiny_model_dir, drafter_dir):
    llm = kangaroo_llm(tiny_model_dir, drafter_dir, quantization="none")
    engine = llm.engine
    runner = engine.speculator.decoders["kangaroo"].drafter.runner
    tokens = PROMPTS[3]
    logits = runner.forward([ForwardItem(tokens, 0, [0, 1], len(tokens))]).logits
    adapter = TrainedDrafter.load(drafter_dir, "kangaroo", KangarooAdapter).network
    (shallow,) = sequence_features(engine.model, [tokens], layer=0)
    rope = engine.model.rope.lookup(torch.arange(len(tokens)))
    out = adapter.forward_train(shallow[None], rope)[0]
    expected = runner.head(out)  # the same (int8) readout of the draft vocabulary
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=1e-4)


def test_the_adapter_catches_up_from_captured_shallow_states(tiny_model_dir, drafter_dir):
    """Tokens the adapter has not read enter it as the shallow hidden states the target's
    steps captured (the shallow layers do not run again): the logits equal reading them all."""
    llm = kangaroo_llm(tiny_model_dir, drafter_dir, quantization="none")
    runner = llm.engine.speculator.decoders["kangaroo"].drafter.runner
    tokens, m = PROMPTS[3], 20
    whole = runner.forward([ForwardItem(tokens, 0, [0, 1], 3)]).logits
    # The target's shallow layers over the first m tokens in other blocks: their K/V in the
    # target's cache, their hidden states as a step captures them; the adapter sees neither.
    batch = runner.flatten([ForwardItem(tokens[:m], 0, [2, 3], 0)])
    captured = runner.model(
        batch.input_ids, batch.positions, runner.kv_cache.layers[: runner.exit_layer],
        batch.attn, hidden_layer=runner.exit_layer - 1, compute_logits=False, all_hidden=True,
    ).hidden_states  # fmt: skip
    rest = ForwardItem(tokens[m:], m, [2, 3], 3)
    # Without the catch-up the adapter reads entries it never wrote: a wrong reading.
    behind = runner.forward([rest]).logits
    assert not torch.allclose(behind, whole, atol=1e-2)
    caught_up = runner.forward([rest], catch_up=[captured]).logits
    torch.testing.assert_close(caught_up, whole, atol=2e-4, rtol=1e-4)


def first_drafts(llm: LLM, draft_every: int, behind: list[int]) -> dict[tuple[int, int], int]:
    """{(prompt, position of the decode token): first draft} of greedy generation with the
    drafter asked only every ``draft_every``-th step (the steps between run plain); each
    drafting sequence's ``tokens_behind`` goes into ``behind``."""
    decoder = llm.engine.speculator.decoders["kangaroo"]
    plan, propose, steps, drafts = decoder.plan, decoder.propose, [0], {}

    def some_steps(seqs, max_drafts):
        steps[0] += 1
        return plan(seqs, max_drafts) if steps[0] % draft_every == 0 else {}

    def recording(seqs, num_drafts):
        behind.extend(decoder.tokens_behind(seq) for seq in seqs)
        proposals = propose(seqs, num_drafts)
        for seq, proposal in proposals.items():
            key = (PROMPTS.index(seq.prompt_token_ids), seq.num_tokens - 1)
            drafts[key] = proposal.token_ids[0]
        return proposals

    decoder.plan, decoder.propose = some_steps, recording
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == [
        o.token_ids for o in LLM(model=str(llm.engine.config.model)).generate(PROMPTS, GREEDY)
    ]
    return drafts


def test_drafts_after_a_stretch_without_drafting_equal_drafting_every_step(
    tiny_model_dir, tmp_path
):
    # A loud attention sublayer: the drafts depend on the adapter's K/V of earlier tokens.
    drafter = save_kangaroo_drafter(tiny_model_dir, tmp_path / "loud", output_scale=1.0)
    behind_every, behind_some = [], []

    def llm() -> LLM:
        return kangaroo_llm(tiny_model_dir, drafter, quantization="none")

    every = first_drafts(llm(), 1, behind_every)
    some = first_drafts(llm(), 3, behind_some)
    both = set(every) & set(some)
    assert len(both) >= 8, both  # the stretches between drafting steps were caught up on
    assert {key: some[key] for key in both} == {key: every[key] for key in both}
    # The adapter's backlog is what the policy leaves unpriced: the prompt on a first draft,
    # then one token a round when drafting every step, a stretch's tokens otherwise.
    shortest_prompt = min(map(len, PROMPTS))
    assert all(b == 1 or b >= shortest_prompt for b in behind_every), behind_every
    assert any(1 < b < shortest_prompt for b in behind_some), behind_some


def test_greedy_equals_autoregressive_batched_preempted_and_aborted(tiny_model_dir, drafter_dir):
    check_greedy_identity_batched_preempted_aborted(
        tiny_model_dir, lambda **overrides: kangaroo_llm(tiny_model_dir, drafter_dir, **overrides)
    )


def test_second_early_exit_stops_doubtful_chains(tiny_model_dir, drafter_dir):
    eager = kangaroo_llm(tiny_model_dir, drafter_dir, threshold=0.0)
    careful = kangaroo_llm(tiny_model_dir, drafter_dir, threshold=0.9)
    for llm in (eager, careful):
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [
            o.token_ids for o in eager.generate(PROMPTS, GREEDY)
        ]
    per_run = [
        llm.engine.speculator.stats.num_draft_tokens / llm.engine.speculator.stats.num_drafts
        for llm in (eager, careful)
    ]
    assert per_run[0] > 3.5 and per_run[1] < per_run[0]


def test_train_learns_resumes_and_writes_a_drafter_the_decoder_loads(tiny_model_dir, tmp_path):
    llm = LLM(model=str(tiny_model_dir), kv_cache={"num_blocks": 256})
    train = [[(7 * i + j) % 300 + 10 for j in range(12)] for i in range(24)]
    held = [[(11 * i + 5 * j) % 300 + 10 for j in range(12)] for i in range(4)]
    options = KangarooTrainOptions(
        output=tmp_path / "drafter",
        max_tokens=24,
        exit_layer=1,
        draft_vocab_size=64,
        top_k=2,
        epochs=1,
        batch_size=8,
        learning_rate=3e-3,
        prompts=(train, held),
    )
    first = run_train_kangaroo(llm, options)
    options.epochs, options.resume = 4, True
    drafter = run_train_kangaroo(llm, options)
    assert first.info["resumed_after_epoch"] == 0
    assert drafter.info["resumed_after_epoch"] == 1
    losses = first.info["epoch_losses"] + drafter.info["epoch_losses"]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert len(drafter.accuracies) == 1 and len(drafter.accuracies[0]) == 2
    expected = llm.generate(PROMPTS[:2], GREEDY)
    got = kangaroo_llm(tiny_model_dir, options.output).generate(PROMPTS[:2], GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def test_a_prefix_hit_reuses_only_the_adapter_entries_computed_for_those_blocks(
    tiny_model_dir, tmp_path
):
    """As EAGLE's (tests/test_eagle.py): the adapter's entries in shared blocks are reused
    where it computed them for that content, and read again (from zeros: the target captured
    nothing there) where the request that filled them never drafted."""
    drafter = save_kangaroo_drafter(tiny_model_dir, tmp_path / "loud", output_scale=1.0)

    def first_draft(first_drafted: bool, seed: int) -> torch.Tensor:
        def make(**overrides):
            return kangaroo_llm(tiny_model_dir, drafter, quantization="none", **overrides)

        return first_draft_after_a_prefix_hit(
            make, "kangaroo", lambda d: d.runner.adapter_cache, first_drafted, seed
        )

    assert torch.equal(first_draft(False, 1), first_draft(False, 2))
    assert not torch.allclose(first_draft(True, 1), first_draft(True, 2))


def test_requests_first_drafting_together_over_shared_blocks_read_the_fresh_entries(
    tiny_model_dir, tmp_path
):
    """As EAGLE's (tests/test_eagle.py), for the adapter's entries."""
    drafter = save_kangaroo_drafter(tiny_model_dir, tmp_path / "loud", output_scale=1.0)

    def first_draft(together: bool) -> torch.Tensor:
        def make(**overrides):
            return kangaroo_llm(tiny_model_dir, drafter, quantization="none", **overrides)

        return first_draft_sharing_a_prefix(make, "kangaroo", together)

    torch.testing.assert_close(first_draft(True), first_draft(False), atol=1e-3, rtol=1e-3)
