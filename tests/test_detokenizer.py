"""IncrementalDetokenizer on the real SmolLM2 tokenizer (byte-level BPE): exact streaming
text, stop strings across token boundaries, held stop tokens, and the logprobs helpers."""

from __future__ import annotations

import random

import pytest

from engine.detokenizer import IncrementalDetokenizer, token_bytes, token_text

TEXTS = [
    "Hello world. Bye",
    "  leading spaces, then\nnewlines\n\n\tand a tab",
    "Emoji 😀👍🏽 and a family 👨‍👩‍👧 and flags 🇯🇵🇫🇷!",
    "中文：世界你好。日本語のテキスト、한국어 텍스트",
    "naïve café über Ωmega — “quotes” … ∑x²",
    "def f(x):\n    return x ** 2  # 平方\n",
]
IM_END = 2  # <|im_end|>, SmolLM2's EOS (a special token)
PERIOD = 30  # "."
SMILE = [10813, 242, 218]  # 😀 split over three byte-level tokens


@pytest.fixture(scope="module")
def tok(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def stream(tok, ids, chunks=1, prompt=(), finish_drop=False, **kw):
    """Push ``ids`` in chunks of ``chunks`` (an int or an rng for random sizes 1..4)."""
    detok = IncrementalDetokenizer(tok, list(prompt), **kw)
    pieces, i = [], 0
    while i < len(ids):
        size = chunks if isinstance(chunks, int) else chunks.randint(1, 4)
        pieces.append(detok.push(ids[i : i + size]).text)
        i += size
    pieces.append(detok.finish(drop_last_token=finish_drop))
    assert "".join(pieces) == detok.text
    return detok, pieces


def char_ids(tok, text):
    """One token per character, so stop strings are checked at every character boundary."""
    return [t for c in text for t in tok.encode(c)]


@pytest.mark.parametrize("chunks", [1, 2, 3, 7, "random"])
def test_real_text_concatenates_to_decode(tok, chunks):
    rng = random.Random(0)
    for text in TEXTS:
        ids = tok.encode(text)
        _, pieces = stream(tok, ids, rng if chunks == "random" else chunks)
        assert "".join(pieces) == tok.decode(ids) == text
        # Split characters are held back, never streamed as U+FFFD and patched later.
        assert not any("\ufffd" in p for p in pieces), pieces


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_ids_concatenate_to_decode(tok, skip_special_tokens):
    # Random ids include specials and stray UTF-8 bytes: text with U+FFFD inside must still
    # match decode exactly, including how invalid bytes collapse into replacement chars.
    rng = random.Random(1234)
    for _ in range(20):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))]
        ids += [rng.choice(SMILE + [IM_END, 0]) for _ in range(3)]
        rng.shuffle(ids)
        kw = {"skip_special_tokens": skip_special_tokens}
        detok, _ = stream(tok, ids, rng, prompt=[rng.randrange(len(tok)) for _ in range(8)], **kw)
        assert detok.text == tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert detok.token_count == len(ids)


def test_first_token_keeps_its_leading_space_after_the_prompt(tok):
    detok, pieces = stream(tok, [7042, PERIOD], prompt=tok.encode("The capital is"))
    assert pieces[0] == " Paris"
    assert detok.text == " Paris."


@pytest.fixture(scope="module")
def metaspace_tok():
    """A tiny SentencePiece-style tokenizer: its decoder strips the leading space of a whole
    text, so a token's text depends on whether something precedes it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [
        "<unk>",
        "<eos>",
        "\u2581The",
        "\u2581capital",
        "\u2581is",
        "\u2581Paris",
        ".",
        "\u2581big",
    ]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>")


def test_predecessor_dependent_decoding_uses_context(metaspace_tok):
    generated = [5, 7, 6, 5]  # ▁Paris ▁big . ▁Paris
    # Decoding each token alone would lose every space; the window keeps them.
    detok, pieces = stream(metaspace_tok, generated)
    assert detok.text == metaspace_tok.decode(generated) == "Paris big. Paris"
    assert pieces[:4] == ["Paris", " big", ".", " Paris"]
    # After a prompt the first token is a continuation and keeps its space (as vLLM does).
    detok, _ = stream(metaspace_tok, generated, prompt=[2, 3, 4])
    assert detok.text == " Paris big. Paris"
    assert token_text(metaspace_tok, 5) == " Paris"


def test_prompt_ending_inside_a_character_lends_no_bytes(tok):
    # The prompt holds the first two bytes of 😀; decode(generated) sees only a stray byte.
    generated = [SMILE[2], *tok.encode(" ok")]
    detok, _ = stream(tok, generated, prompt=[*tok.encode("Hi "), *SMILE[:2]])
    assert detok.text == tok.decode(generated) == "\ufffd ok"


def test_stop_string_spanning_tokens_emits_text_before_it_only(tok):
    ids = tok.encode("Hello world. Bye")  # Hello| world|.| By|e
    for chunks in (1, len(ids)):
        detok, pieces = stream(tok, ids, chunks, stop=[" world"])
        assert detok.text == "Hello"
        assert (detok.stopped, detok.stop_string) == (True, " world")
        assert detok.token_count == 2  # " world" completed the stop; later tokens dropped
        assert pieces[-1] == ""  # finish after a stop adds nothing


def test_stop_strings_wait_for_min_tokens(tok):
    ids = tok.encode("Hello world. Bye world!")  # Hello| world|.| By|e| world|!
    # " world" completes at token 2: a stop from min_tokens 2 on, text before (vLLM).
    detok, _ = stream(tok, ids, 1, stop=[" world"], min_tokens=2)
    assert (detok.text, detok.token_count) == ("Hello", 2)
    detok, _ = stream(tok, ids, 1, stop=[" world"], min_tokens=3)
    assert detok.text == "Hello world. Bye" and detok.stop_string == " world"
    assert detok.token_count == 6
    detok, _ = stream(tok, ids, len(ids), stop=[" world"], min_tokens=7)
    assert detok.text == "Hello world. Bye world!" and not detok.stopped


def test_stop_string_completed_by_the_next_token(tok):
    detok = IncrementalDetokenizer(tok, [], [" world"])
    assert detok.push([458]).text == ""  # " wor": could be the stop, held back
    delta = detok.push([400, PERIOD])  # "ld": completes it
    assert (delta.text, delta.stopped, delta.stop_string) == ("", True, " world")
    assert detok.token_count == 2


def test_stop_inside_a_split_character(tok):
    ids = tok.encode("世界 ok")
    detok, _ = stream(tok, ids, stop=["界"])
    assert detok.text == "世"
    assert detok.stop_string == "界"


def test_partial_stop_is_held_then_released_when_it_diverges(tok):
    detok = IncrementalDetokenizer(tok, [], [" world"])
    assert detok.push([19556]).text == "Hello"
    held = detok.push([458])  # " wor"
    assert (held.text, held.stopped) == ("", False)
    released = detok.push([6325])  # "ship": " worship" is not " world"
    assert (released.text, released.stopped) == (" worship", False)
    assert detok.finish() == ""
    assert detok.text == "Hello worship"


def test_partial_stop_at_the_end_is_released_by_finish(tok):
    detok = IncrementalDetokenizer(tok, [], [" world", "Bye"])
    assert detok.push([19556, 458]).text == "Hello"
    assert detok.finish() == " wor"
    assert not detok.stopped
    assert detok.text == "Hello wor"


@pytest.mark.parametrize("stops", [[" three", " two"], [" two", " three"]])
def test_earliest_of_several_stops_wins(tok, stops):
    detok, _ = stream(tok, tok.encode("one two three four"), stop=stops)
    assert detok.text == "one"
    assert detok.stop_string == " two"


@pytest.mark.parametrize("per_char", [True, False])
def test_earliest_start_wins_whatever_the_token_boundaries(tok, per_char):
    # Character by character, "o t" completes before "two three" does; "two three" starts
    # earlier, so it must win, as it does when whole words arrive at once.
    text = "one two three four"
    ids = char_ids(tok, text) if per_char else tok.encode(text)
    detok, _ = stream(tok, ids, stop=["o t", "two three"])
    assert detok.text == "one "
    assert detok.stop_string == "two three"


def test_random_chunking_with_stops_matches_decode_cut_at_the_stop(tok):
    rng = random.Random(7)
    for text in TEXTS:
        ids = tok.encode(text)
        full = tok.decode(ids)
        stop = full[len(full) // 2 : len(full) // 2 + 3]
        expected = full[: full.find(stop)]
        for _ in range(3):
            detok, _ = stream(tok, ids, rng, stop=[stop, "never appears"])
            assert (detok.text, detok.stop_string) == (expected, stop)


def test_drop_last_token_leaves_out_a_held_stop_token(tok):
    ids = [*tok.encode("Hello world"), PERIOD]
    for drop, tail in ((True, ""), (False, ".")):
        detok = IncrementalDetokenizer(tok, [], stop_token_ids=[PERIOD])
        assert detok.push(ids).text == "Hello world"  # "." held: it may end the choice
        assert detok.finish(drop_last_token=drop) == tail
        assert detok.text == "Hello world" + tail
        assert detok.token_count == 3


def test_held_stop_token_is_released_when_generation_goes_on(tok):
    # ignore_eos / min_tokens: the stop token was not the last one after all.
    detok = IncrementalDetokenizer(tok, [], stop_token_ids=[PERIOD])
    assert detok.push([19556, PERIOD]).text == "Hello"
    assert detok.push([1428]).text == ". By"
    assert detok.finish(drop_last_token=False) == ""
    assert detok.text == "Hello. By"


def test_eos_text_dropped_when_special_tokens_are_shown(tok):
    for drop, tail in ((True, ""), (False, "<|im_end|>")):
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
        assert detok.push([19556, IM_END]).text == "Hello"
        assert detok.finish(drop_last_token=drop) == tail


def test_finish_releases_an_unfinished_character_as_decode_does(tok):
    detok = IncrementalDetokenizer(tok, [])
    assert detok.push(SMILE[:2]).text == ""
    assert detok.finish() == tok.decode(SMILE[:2]) == "\ufffd"


def test_push_after_stop_is_empty_and_push_after_finish_raises(tok):
    detok = IncrementalDetokenizer(tok, [], ["."])
    assert detok.push([19556, PERIOD, 1428]).stopped
    late = detok.push([85])
    assert (late.text, late.stopped, late.stop_string) == ("", True, ".")
    assert detok.token_count == 2
    detok.finish()
    with pytest.raises(RuntimeError):
        detok.push([85])


def test_token_text_and_bytes(tok):
    assert token_text(tok, 7042) == " Paris"
    assert token_bytes(tok, 7042) == list(b" Paris")
    assert token_text(tok, IM_END) == "<|im_end|>"
    # A split character: the text shows U+FFFD, the bytes are exact and join up.
    assert token_text(tok, SMILE[0]) == "\ufffd"
    assert bytes(b for t in SMILE for b in token_bytes(tok, t)) == "😀".encode()


class _CountingTokenizer:
    """Forwards to a tokenizer and records how many ids each decode call gets."""

    def __init__(self, tok):
        self._tok = tok
        self.decode_lengths: list[int] = []

    def decode(self, ids, **kw):
        self.decode_lengths.append(len(ids))
        return self._tok.decode(ids, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_decode_windows_stay_short_for_long_streams(tok):
    # Structure, not timing: a whole-sequence decode per step would make the windows grow
    # with the stream (O(n^2)). Runs of skipped specials must not grow them either.
    counting = _CountingTokenizer(tok)
    ids = tok.encode(" ".join(TEXTS) * 4) + [IM_END] * 100 + tok.encode("the end")
    detok = IncrementalDetokenizer(counting, tok.encode("prompt"), [" never"])
    counting.decode_lengths.clear()  # setup (special-id check, prompt context) done
    for t in ids:
        detok.push([t])
    detok.finish()
    assert detok.text == tok.decode(ids, skip_special_tokens=True)
    assert max(counting.decode_lengths) <= 12
    assert len(counting.decode_lengths) <= 2 * len(ids) + 2


def test_stops_starting_at_the_same_place_report_the_shorter(tok):
    # Character by character the shorter one completes first; whole tokens must agree.
    detok, _ = stream(tok, tok.encode("Hello world. Bye"), stop=[" world.", " world"])
    assert (detok.text, detok.stop_string) == ("Hello", " world")
