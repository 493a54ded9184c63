"""The global suffix index of tooling/bench/suffix_simulation.py: what it drafts from earlier
answers, its gates, and the replay's counts, on hand-made token sequences."""

from __future__ import annotations

from tooling.bench.suffix_simulation import SuffixIndex, replay, sources


def test_the_longest_suffix_proposes_its_most_frequent_continuation():
    index = SuffixIndex([[1, 2, 3, 4, 5], [9, 2, 3, 7, 8], [6, 2, 3, 7, 8]])
    # "2 3" was followed by 7 8 twice and by 4 5 once.
    assert index.draft([0, 2, 3], k=4) == [7, 8]
    # The longer suffix "1 2 3" occurred once, followed by 4 5: the longest match decides.
    assert index.draft([1, 2, 3], k=4) == [4, 5]
    assert index.draft([2, 3], k=1) == [7]
    assert index.draft([42, 43], k=4) == []  # never seen


def test_a_continuation_never_crosses_into_the_next_answer():
    index = SuffixIndex([[1, 2, 3], [4, 5, 6]])
    assert index.draft([1, 2, 3], k=4, min_n=3) == []  # the first answer ended there
    assert index.draft([1, 2], k=4) == [3]


def test_the_gates_hold_back_rare_and_split_suffixes():
    index = SuffixIndex([[1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 3, 4]])
    assert index.draft([1, 2], k=2, share=0.5) == [3, 4]  # 2 of 3 matches went on with 3
    assert index.draft([1, 2], k=2, share=0.9) == []  # ... which is under 90%
    assert index.draft([1, 2], k=2, min_count=4) == []  # and "1 2" was seen only 3 times
    assert index.draft([0, 9, 2], k=2, min_n=2) == []  # "9 2" never occurred; 1-grams are off


def test_the_replay_counts_steps_rows_and_accepted_drafts():
    answer = [5, 6, 7, 8]

    def drafter(context, k):
        return [6, 7, 0] if context[-1] == 5 else []

    # Step 1 (after the prompt's 1) has no draft and emits 5; step 2 drafts 6 7 0 after 5:
    # 6 and 7 stand, and the step emits them and the answer's 8. 4 tokens in 2 steps; 3 rows
    # drafted, 2 of them stood.
    r = replay([([1], answer)], drafter)
    assert (r.tokens_per_step, r.rows_per_step) == (2.0, 1.5)
    assert abs(r.acceptance - 2 / 3) < 1e-9


def test_both_takes_prompt_lookup_first_and_the_index_otherwise():
    index = SuffixIndex([[7, 8, 9, 10]])
    drafters = sources(index, min_n=2, count=1, share=0.5)
    context = [1, 2, 3, 4, 1, 2, 3]  # its own "1 2 3" was followed by 4
    assert drafters["both"](context, 2) == [4, 1]
    assert drafters["both"]([0, 7, 8], 2) == [9, 10]  # no 3-token match in itself
    assert drafters["local"]([0, 7, 8], 2) == []
