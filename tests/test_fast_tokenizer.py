"""The API process's tokenizer (no transformers, no torch) against transformers' own on the
same files: the same ids, text, tokens, chat renderings and llguidance vocabulary."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.fast_tokenizer import FastTokenizer

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "Unicode: café, naïve, 日本語, emoji 🙂, ÆØÅ",
    "<|im_start|>user\nspecial tokens in text<|im_end|>",
    "code:\n\tdef f(x):\n\t\treturn x ** 2  # don't",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be terse."},
     {"role": "user", "content": "Why is the sky blue?"},
     {"role": "assistant", "content": "Rayleigh scattering."},
     {"role": "user", "content": "More."}],
]  # fmt: skip


@pytest.fixture(scope="module")
def pair(smollm2_path):
    from transformers import AutoTokenizer

    return FastTokenizer(smollm2_path), AutoTokenizer.from_pretrained(smollm2_path)


def test_ids_and_text_match_transformers(pair):
    fast, hf = pair
    for text in TEXTS:
        for special in (True, False):
            ids = hf.encode(text, add_special_tokens=special)
            assert fast.encode(text, add_special_tokens=special) == ids
            for skip in (True, False):
                assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(
                    ids, skip_special_tokens=skip
                )
    ids = hf.encode(TEXTS[2])
    assert fast.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert fast.convert_ids_to_tokens(ids[0]) == hf.convert_ids_to_tokens(ids[0])
    # A partial UTF-8 sequence decodes to the same replacement text (the detokenizer relies on it).
    emoji = hf.encode("🙂", add_special_tokens=False)
    assert fast.decode(emoji[:1]) == hf.decode(emoji[:1])


def test_special_tokens_match_transformers(pair):
    fast, hf = pair
    assert fast.eos_token_id == hf.eos_token_id and fast.eos_token == hf.eos_token
    assert fast.bos_token_id == hf.bos_token_id and fast.pad_token_id == hf.pad_token_id
    assert set(fast.all_special_ids) == set(hf.all_special_ids)
    specials = {i for i, t in hf.added_tokens_decoder.items() if t.special}
    assert {i for i, t in fast.added_tokens_decoder.items() if t.special} == specials
    assert len(fast) == len(hf)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_renderings_match_transformers(pair, conversation):
    fast, hf = pair
    for flags in ({"add_generation_prompt": True}, {"add_generation_prompt": False}):
        assert fast.apply_chat_template(conversation, tokenize=False, **flags) == (
            hf.apply_chat_template(conversation, tokenize=False, **flags)
        )
        assert fast.apply_chat_template(conversation, **flags) == hf.apply_chat_template(
            conversation, **flags, return_dict=False
        )
    partial = [*conversation, {"role": "assistant", "content": "The answer is "}]
    assert fast.apply_chat_template(partial, tokenize=False, continue_final_message=True) == (
        hf.apply_chat_template(partial, tokenize=False, continue_final_message=True)
    )
    with pytest.raises(ValueError, match="not compatible"):
        fast.apply_chat_template(partial, continue_final_message=True, add_generation_prompt=True)


def test_template_errors_and_variables_behave_as_in_transformers(pair):
    from jinja2 import TemplateError

    fast, hf = pair
    template = (
        "{% if shout %}{{ messages[0]['content'] | upper }}{% else %}"
        "{{ raise_exception('no shout') }}{% endif %}{{ eos_token }}{{ x | tojson }}"
    )
    kwargs = dict(chat_template=template, tokenize=False, x={"é": [1, 2]})
    assert fast.apply_chat_template(CONVERSATIONS[0], shout=True, **kwargs) == (
        hf.apply_chat_template(CONVERSATIONS[0], shout=True, **kwargs)
    )
    with pytest.raises(TemplateError, match="no shout"):
        fast.apply_chat_template(CONVERSATIONS[0], shout=False, **kwargs)


def test_an_older_layout_with_the_template_in_the_config(smollm2_path, tmp_path):
    """tokenizer_config.json carrying the template, added tokens and clean-up (the layout
    transformers 4 saves), read the same by both."""
    from transformers import AutoTokenizer

    shutil.copy(smollm2_path / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((smollm2_path / "tokenizer_config.json").read_text())
    config["chat_template"] = (smollm2_path / "chat_template.jinja").read_text()
    config["clean_up_tokenization_spaces"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    fast, hf = FastTokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    ids = hf.encode("Hello , world ! It 's fine .")
    assert fast.decode(ids) == hf.decode(ids)  # (transformers skips the clean-up for BPE)
    config["clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    forced, hf_forced = FastTokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert forced.decode(ids) == hf_forced.decode(ids) == "Hello, world! It's fine."
    assert fast.apply_chat_template(CONVERSATIONS[1], tokenize=False) == hf.apply_chat_template(
        CONVERSATIONS[1], tokenize=False
    )


def test_the_llguidance_vocabulary_is_the_same(pair):
    import llguidance.hf

    fast, hf = pair
    ours = fast.llguidance(len(hf), [hf.eos_token_id])
    theirs = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf), eos_token=[hf.eos_token_id])
    for text in TEXTS[:3]:
        assert ours.tokenize_str(text) == theirs.tokenize_str(text)
    assert ours.vocab_size == theirs.vocab_size and ours.eos_token == theirs.eos_token
