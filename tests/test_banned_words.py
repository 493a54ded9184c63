"""Banned words and phrases: matching on the text, and outputs that never contain them even
when the model is pushed towards them, with speculation, grammars and batches."""

from __future__ import annotations

import re
import shutil

import pytest

from engine import LLM, SamplingParams
from engine.constraints import ConstraintSpec
from engine.constraints.banned import normalize_phrase, scan
from tests.tiny_models import save_perturbed_copy

PHRASES = [normalize_phrase(p) for p in ["cat", "New  York"]]


@pytest.mark.parametrize(
    ("text", "final", "violation", "pending"),
    [
        ("the cat sat", False, 4, 11),
        ("the cat", False, None, 4),  # is it "cat" or "category"? held back
        ("the cat", True, 4, 7),  # the output ends: it was "cat"
        ("the category", False, None, 12),
        ("the CAT.", False, 4, 8),
        ("the ca", False, None, 4),
        ("I love new \n YORK!", False, 7, 18),
        ("renew york.", False, None, 11),
        ("new yorker", False, None, 10),
        ("new yo", False, None, 0),
        ("concat", True, None, 6),
    ],
)
def test_scan_finds_whole_words_in_any_casing(text, final, violation, pending):
    found = scan(text, PHRASES, 0, final)
    assert (found.violation, found.pending) == (violation, pending)


def _occurs(text: str, phrase: str) -> bool:
    words = r"\s+".join(map(re.escape, phrase.split()))
    return re.search(rf"(?<!\w){words}(?!\w)", text, flags=re.IGNORECASE) is not None


@pytest.fixture(scope="module")
def tempting(tiny_chat_model_dir):
    """The tiny chat model pushed towards " cat" / "cat" / " the" by a logit bias."""
    llm = LLM(model=str(tiny_chat_model_dir))
    ids = {w: llm.tokenizer.encode(w, add_special_tokens=False) for w in [" cat", "cat", " the"]}
    assert all(len(v) == 1 for v in ids.values()), ids
    bias = {v[0]: 9.0 for v in ids.values()}
    return llm, bias


def _sample(llm, bias, banned, seeds, n=100, **kw):
    texts = []
    for seed in seeds:
        params = SamplingParams(temperature=1.0, n=n, seed=seed * n, max_tokens=12,
                                logit_bias=bias, banned_words=banned, **kw)  # fmt: skip
        texts += [c.text for c in llm.generate(["Once"], params)[0].outputs]
    return texts


def test_a_thousand_tempted_samples_never_contain_the_phrase(tempting):
    llm, bias = tempting
    free = _sample(llm, bias, [], seeds=range(2))
    assert sum(_occurs(t, "cat") for t in free) > 50  # the bias does tempt
    banned = _sample(llm, bias, ["CAT", "the cat"], seeds=range(10))
    assert len(banned) == 1000
    assert not any(_occurs(t, "cat") or _occurs(t, "the cat") for t in banned)
    assert llm.engine.num_rewinds > 0
    assert any("cat" in t.lower() for t in banned)  # inside other words it stays allowed


def test_with_speculation_greedy_is_identical_and_samples_stay_clean(
    tempting, tiny_chat_model_dir, tmp_path_factory
):
    llm, bias = tempting
    draft_dir = save_perturbed_copy(tiny_chat_model_dir, tmp_path_factory.mktemp("d") / "m", 0.02)
    shutil.copy(tiny_chat_model_dir / "tokenizer.json", draft_dir / "tokenizer.json")
    spec_llm = LLM(
        model=str(tiny_chat_model_dir),
        decoder={"method": "draft", "draft": {"model": str(draft_dir)},
                 "draft_policy": "fixed", "num_speculative_tokens": 4},
    )  # fmt: skip
    prompts = ["Once", "The", "A cat"]
    greedy = SamplingParams(temperature=0, max_tokens=24, logit_bias=bias, banned_words=["cat"])
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    drafted = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, greedy)]
    assert drafted == plain
    sampled = _sample(spec_llm, bias, ["cat"], seeds=range(3))
    assert not any(_occurs(t, "cat") for t in sampled)
    assert spec_llm.engine.speculator.stats.num_draft_tokens > 0


def test_config_list_and_grammar_compose(tiny_chat_model_dir):
    llm = LLM(model=str(tiny_chat_model_dir), banned_words=["cat"])
    choice = ConstraintSpec("choice", ["cat", "dog", "cow"])
    outs = llm.generate(
        ["Pick"], SamplingParams(temperature=1.0, n=60, seed=3, max_tokens=6, constraint=choice)
    )
    texts = {c.text for c in outs[0].outputs}
    assert texts <= {"dog", "cow"} and texts


def test_nothing_leaks_after_rewinds(tempting):
    llm, bias = tempting
    _sample(llm, bias, ["cat"], seeds=[99], n=20)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.engine.has_unfinished_requests()


def test_banned_words_are_validated():
    with pytest.raises(ValueError, match="banned_words"):
        SamplingParams(banned_words=["  ", "ok"])


def test_a_model_set_on_a_phrase_ends_instead_of_rewinding_forever(tiny_chat_model_dir):
    """Fault injection: bans that mask nothing, so every rewind meets the phrase again."""
    from engine.constraints import banned

    llm = LLM(model=str(tiny_chat_model_dir))
    token = llm.tokenizer.encode(" cat", add_special_tokens=False)[0]
    original = banned.BannedPhrasesState.mask_, banned.BannedPhrasesState.allows
    # As if every rewind met the phrase through tokens not banned yet.
    banned.BannedPhrasesState.mask_ = lambda self, logits, history: None
    banned.BannedPhrasesState.allows = lambda self, history: True
    try:
        params = SamplingParams(temperature=0, max_tokens=8, logit_bias={token: 100.0},
                                banned_words=["cat"])  # fmt: skip
        out = llm.generate(["Once"], params)[0].outputs[0]
    finally:
        banned.BannedPhrasesState.mask_, banned.BannedPhrasesState.allows = original
    assert out.finish_reason == "stop" and not _occurs(out.text, "cat")
    assert llm.engine.num_rewinds == banned.MAX_REWINDS + 1


@pytest.mark.parametrize("phrase", ["猫", "🫖 ok"])
def test_phrases_of_characters_split_across_tokens_are_caught(smollm2_path, phrase):
    from transformers import AutoTokenizer

    from engine.constraints.banned import BannedPhrasesState

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    tokens = tokenizer.encode(f"I like {phrase} a lot", add_special_tokens=False)
    # The phrase's first character takes several byte-level tokens: the case this is about.
    first = phrase[0]
    assert any(tokenizer.decode([t]).endswith("\ufffd") for t in tokens), first
    state = BannedPhrasesState([normalize_phrase(phrase)], tokenizer.decode)
    output = []
    for token in tokens:
        output.append(token)
        rewind_to = state.check(output, final=False)
        settled = tokenizer.decode(output[: state.stable])
        assert first not in settled  # nothing of the phrase is ever reported
        if rewind_to is not None:
            break
    assert rewind_to is not None, "the occurrence was never found"
    assert tokenizer.decode(output[rewind_to:]).lstrip().startswith(first)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_whose_every_choice_is_banned_ends_within_it(tiny_chat_model_dir, temperature):
    # Each rewind bans one more way into "cat" or "dog" until the grammar has no token left:
    # the row is masked whole, and the sequence must stop rather than emit an arbitrary token
    # (after which the grammar could no longer follow it, and nothing would be constrained).
    llm = LLM(model=str(tiny_chat_model_dir))
    choice = ConstraintSpec("choice", ["cat", "dog"])
    params = SamplingParams(
        temperature=temperature, seed=5, n=3, max_tokens=8, constraint=choice,
        banned_words=["cat", "dog"],
    )  # fmt: skip
    for out in llm.generate(["Pick"], params)[0].outputs:
        # It stops where no token is left: a prefix of a choice, never a banned word.
        assert out.finish_reason == "stop", out.text
        assert out.text in {"", "c", "ca", "d", "do"}
    assert llm.engine.num_rewinds > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_characters_that_lower_to_two_match_as_one():
    # "İ".lower() is "i" plus a combining dot: phrase and text must be lowered alike.
    phrase = normalize_phrase("İstanbul")
    for text in ["I love İstanbul.", "I love ISTANBUL.", "I love istanbul."]:
        assert scan(text, [phrase], 0, final=True).violation == 7, text


def test_sampling_params_with_a_sequence_matcher_pickle_without_it(tiny_chat_model_dir):
    import pickle

    llm = LLM(model=str(tiny_chat_model_dir))
    params = SamplingParams(max_tokens=4, constraint=ConstraintSpec("choice", ["yes", "no"]))
    state = llm.engine.constraints.state(params.constraint)
    copy = pickle.loads(pickle.dumps(params.for_sequence(state)))
    assert copy.constraint_state is None and copy.constraint == params.constraint


def test_a_stop_token_after_a_phrase_ends_the_word(tempting):
    """A stop token's text is left out of the output, so "cat" followed by a stop token "s"
    ends on the word "cat": it is rewound like any other occurrence."""
    llm, _ = tempting
    cat, s = (llm.tokenizer.encode(w, add_special_tokens=False) for w in ["cat", "s"])
    assert len(cat) == 1 and len(s) == 1
    bias = {cat[0]: 9.0, s[0]: 9.0}

    def outputs(banned):
        found = []
        for seed in range(3):
            params = SamplingParams(
                temperature=1.0, n=100, seed=seed * 100, max_tokens=12, stop_token_ids=s,
                logit_bias=bias, banned_words=banned,
            )  # fmt: skip
            found += llm.generate(["Once"], params)[0].outputs
        return found

    cut_short = [c for c in outputs([]) if c.token_ids[-2:] == [*cat, *s]]
    assert any(_occurs(c.text, "cat") for c in cut_short)  # "cats", shown as the word "cat"
    assert not any(_occurs(c.text, "cat") for c in outputs(["cat"]))


def test_config_phrases_need_a_word_character():
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="banned_words"):
        EngineConfig.from_dict({"banned_words": ["cat", "..."]})
