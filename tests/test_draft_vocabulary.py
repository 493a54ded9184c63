"""Drafters with a draft vocabulary (eagle, kangaroo) draft over its columns alone when no
row's logits need processing (``ModelDrafter.draft``): the tokens, q rows (spread back over
the whole vocabulary for the verifier), confidences and entropies must equal what the
whole-vocabulary path gives, for greedy and sampled requests. The draft vocabulary here is a
shuffled part of the vocabulary, as a trained drafter's is (ranked by frequency)."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from tests.tiny_models import save_eagle_drafter, save_kangaroo_drafter

pytestmark = pytest.mark.usefixtures("single_torch_thread")

# 20 tokens each: the drafts after the decode token still fit the second block.
PROMPTS = [[5, 6, 7, 8, 9] * 4, [11, 12, 13] * 6 + [14, 15], [40 + i % 9 for i in range(20)]]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=8),
    SamplingParams(temperature=1.0, seed=3, max_tokens=8),
    SamplingParams(temperature=1.0, seed=4, max_tokens=8),
]


def _drafter_dir(kind, model_dir, path):
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    part = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[: vocab * 3 // 4]
    if kind == "eagle":
        return save_eagle_drafter(model_dir, path, scale=3.0, draft_vocab=part)
    return save_kangaroo_drafter(model_dir, path, draft_vocab=part)


def _first_round(kind, model_dir, drafter_dir) -> tuple[dict, list[bool]]:
    """The proposals of one drafting round, and the ``compact`` flag of each forward call."""
    options = {"drafter": str(drafter_dir)}
    if kind == "kangaroo":
        options["exit_threshold"] = 0.0  # draft the whole grant
    decoder = {"method": kind, kind: options, "draft_policy": "fixed"}
    engine = LLM(model=str(model_dir), decoder=decoder).engine
    drafter = engine.speculator.decoders[kind].drafter
    forward, compact = drafter.forward, []

    def spy(seqs, chains, num_logits, **options):
        compact.append(options.get("compact", False))
        return forward(seqs, chains, num_logits, **options)

    drafter.forward = spy
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        engine.add_request(f"r{i}", prompt, params)
    engine.step()  # prefill (and the target's features for eagle)
    seqs = list(engine.scheduler.running)
    proposals = drafter.draft(seqs, {s: 3 for s in seqs})
    return {s.request_id: (s, p) for s, p in proposals.items()}, compact


@pytest.mark.parametrize("kind", ["eagle", "kangaroo"])
def test_draft_vocabulary_steps_draft_what_whole_vocabulary_steps_draft(
    kind, tiny_model_dir, tmp_path, monkeypatch
):
    drafter_dir = _drafter_dir(kind, tiny_model_dir, tmp_path / "d")
    compact, calls = _first_round(kind, tiny_model_dir, drafter_dir)
    assert calls and all(calls)  # every draft step took the draft-vocabulary path
    # Rows that seem to need processing take the whole-vocabulary path (processing changes
    # nothing here, so the two paths must agree).
    monkeypatch.setattr("engine.decoders.drafting.needs_processing", lambda row: True)
    whole, calls = _first_round(kind, tiny_model_dir, drafter_dir)
    assert calls and not any(calls)
    assert compact.keys() == whole.keys() == {"r0", "r1", "r2"}
    for request_id, (seq, got) in compact.items():
        want = whole[request_id][1]
        assert got.token_ids == want.token_ids and len(got.token_ids) == 3
        assert got.confidences == pytest.approx(want.confidences, rel=1e-5)
        assert got.entropies == pytest.approx(want.entropies, rel=1e-5, abs=1e-6)
        if seq.sampling_params.greedy:
            assert got.draft_probs is None and want.draft_probs is None
        else:
            torch.testing.assert_close(got.draft_probs, want.draft_probs, atol=1e-6, rtol=1e-5)
