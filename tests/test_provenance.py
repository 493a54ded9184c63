"""Token provenance (return_provenance): which tokens came from accepted drafts, resampled
rejections, bonus tokens and plain steps."""

from __future__ import annotations

from engine import LLM, SamplingParams
from engine.provenance import sources_of_run


def test_sources_of_chains_and_trees():
    assert sources_of_run(0, [], None) == ["plain"]
    assert sources_of_run(3, [0, 1], None) == ["accepted", "accepted", "resampled"]
    assert sources_of_run(2, [0, 1], None) == ["accepted", "accepted", "bonus"]
    parents = [-1, -1, 0]  # nodes 0 and 1 under the root, node 2 under node 0
    assert sources_of_run(3, [1], parents) == ["accepted", "bonus"]  # node 1 is a leaf
    assert sources_of_run(3, [0], parents) == ["accepted", "resampled"]  # node 2 was rejected
    assert sources_of_run(3, [], parents) == ["resampled"]


def test_engine_sources_agree_with_the_speculators_counts(tiny_model_dir, tiny_draft_model_dir):
    llm = LLM(
        model=str(tiny_model_dir),
        decoder={"method": "draft", "draft": {"model": str(tiny_draft_model_dir)},
                 "draft_policy": "fixed", "num_speculative_tokens": 3},
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, return_provenance=True)
    out = llm.generate([[5, 6, 7, 8]], params)[0].outputs[0]
    stats = llm.engine.speculator.stats
    assert len(out.sources) == len(out.token_ids) == 40
    assert out.sources.count("accepted") == stats.num_accepted_tokens > 0
    # One non-accepted token per step: the prefill's plain token, then one per verification
    # (a final step may be cut short by max_tokens).
    assert out.sources[0] == "plain"
    assert (
        out.sources[1:].count("resampled") + out.sources[1:].count("bonus") >= stats.num_drafts - 1
    )
    plain = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert plain.sources is None
