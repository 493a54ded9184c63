"""A model's tokenizer without transformers: the Rust ``tokenizers`` library over the model's
``tokenizer.json``, and its chat template rendered with jinja2 as transformers renders it.

The API process tokenizes, renders chat templates and detokenizes for every request, but
importing transformers imports torch (hundreds of MB the API process never otherwise uses).
This class offers the part of a transformers fast tokenizer the server and the detokenizer
use, with the same results (tests/test_fast_tokenizer.py holds it to transformers on the
shipped model); a model directory without ``tokenizer.json`` (a slow, Python-only tokenizer)
is loaded with transformers instead (``engine.tokenizer_files``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from copy import copy
from datetime import datetime
from functools import cached_property
from pathlib import Path

import jinja2
import llguidance
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer

FORCE_BPE_CLEAN_UP = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")  # fmt: skip


class FastTokenizer:
    """``encode``, ``decode``, ``convert_ids_to_tokens``, ``apply_chat_template`` and the
    special-token attributes of a transformers fast tokenizer, from its files."""

    def __init__(self, model_dir: str | Path):

        model_dir = Path(model_dir)
        self.name_or_path = str(model_dir)
        self.backend_tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config = _json(model_dir / "tokenizer_config.json")
        special_map = _json(model_dir / "special_tokens_map.json")
        self._add_configured_tokens(config)
        # transformers 5 skips the clean-up for BPE vocabularies (it would strip real spaces
        # before punctuation) unless told to force it.
        bpe = json.loads(self.backend_tokenizer.to_str())["model"]["type"] == "BPE"
        forced = config.get(FORCE_BPE_CLEAN_UP)
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces")) and (
            not bpe or bool(forced)
        )
        self.special_tokens = {
            name: _content(config.get(name, special_map.get(name)))
            for name in SPECIAL_NAMES
            if _content(config.get(name, special_map.get(name))) is not None
        }
        extra = config.get("additional_special_tokens") or special_map.get(
            "additional_special_tokens"
        )
        self.additional_special_tokens = [_content(t) for t in extra or []]
        self.chat_template = _chat_template(model_dir, config)

    def _add_configured_tokens(self, config: dict) -> None:
        """tokenizer_config.json's added tokens that tokenizer.json lacks (transformers adds
        them to the backend on load, so ids and text agree)."""

        known = self.backend_tokenizer.get_added_tokens_decoder()
        for index, token in (config.get("added_tokens_decoder") or {}).items():
            if int(index) in known:
                continue
            added = AddedToken(
                token["content"],
                single_word=token.get("single_word", False),
                lstrip=token.get("lstrip", False),
                rstrip=token.get("rstrip", False),
                normalized=token.get("normalized", True),
                special=token.get("special", False),
            )
            if added.special:
                self.backend_tokenizer.add_special_tokens([added])
            else:
                self.backend_tokenizer.add_tokens([added])

    # ---- the special tokens ------------------------------------------------------------
    def __getattr__(self, name: str):
        # bos_token / bos_token_id and the like, None where the model has none.
        if name in SPECIAL_NAMES:
            return self.__dict__.get("special_tokens", {}).get(name)
        if name.endswith("_id") and name[:-3] in SPECIAL_NAMES:
            token = self.__dict__.get("special_tokens", {}).get(name[:-3])
            return None if token is None else self.backend_tokenizer.token_to_id(token)
        raise AttributeError(name)

    @property
    def added_tokens_decoder(self) -> dict:
        return self.backend_tokenizer.get_added_tokens_decoder()

    @property
    def all_special_tokens(self) -> list[str]:
        tokens = list(self.special_tokens.values()) + self.additional_special_tokens
        return list(dict.fromkeys(tokens))

    @property
    def all_special_ids(self) -> list[int]:
        ids = (self.backend_tokenizer.token_to_id(t) for t in self.all_special_tokens)
        return [i for i in ids if i is not None]

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    # ---- text <-> ids ------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The batch call releases the GIL while Rust works (``encode`` holds it: a 2 MB prompt
        # stalled every other thread, the server's event loop included, for 0.8 s), and its
        # fast variant skips the offsets nobody reads here: the same ids in 0.43x the time.
        backend = self.backend_tokenizer
        batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
        return batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        text = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.clean_up_tokenization_spaces else text

    def convert_ids_to_tokens(self, ids: int | Sequence[int]):
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]):
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    # ---- chat templates ----------------------------------------------------------------
    def apply_chat_template(
        self,
        conversation: list[dict],
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        padding: bool = False,
        truncation: bool = False,
        max_length: int | None = None,
        return_tensors: str | None = None,
        return_dict: bool = False,
        return_assistant_tokens_mask: bool = False,
        tokenizer_kwargs: dict | None = None,
        **kwargs,
    ):
        """The conversation rendered by the model's template (transformers' variables and
        helpers: the special tokens, ``raise_exception``, ``strftime_now``, ``tojson``);
        token ids when ``tokenize``, else the text."""
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt are not compatible. Use "
                "continue_final_message when you want the model to continue the final message, "
                "and add_generation_prompt when you want to add a header that will prompt it to "
                "start a new assistant message instead."
            )
        source = self._template(chat_template, tools)
        variables = {**self.special_tokens, **kwargs}
        rendered = _compiled(source).render(
            messages=conversation, tools=tools, documents=documents,
            add_generation_prompt=add_generation_prompt, **variables,
        )  # fmt: skip
        if continue_final_message:
            rendered = _cut_after_final_message(rendered, conversation[-1])
        if not tokenize:
            return rendered
        return self.encode(rendered, add_special_tokens=False)

    def _template(self, chosen: str | None, tools) -> str:
        templates = self.chat_template
        if isinstance(templates, dict):
            if chosen in templates:
                return templates[chosen]
            name = "tool_use" if tools and "tool_use" in templates else "default"
            if chosen is None and name in templates:
                return templates[name]
        elif chosen is None and templates is not None:
            return templates
        if chosen is not None:
            return chosen
        raise ValueError(
            "Cannot use chat template functions because tokenizer.chat_template is not set "
            "and no template argument was passed!"
        )

    @cached_property
    def _vocab_json(self) -> str:
        """tokenizer.json as llguidance reads it: without padding or truncation."""

        backend = copy(self.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        return backend.to_str()

    def llguidance(self, n_vocab: int, eos_token_ids: list[int]):
        """The llguidance tokenizer of this vocabulary (what llguidance.hf makes from a
        transformers tokenizer, from the same tokenizer.json)."""

        return llguidance.LLTokenizer(self._vocab_json, n_vocab=n_vocab, eos_token=eos_token_ids)


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _content(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _chat_template(model_dir: Path, config: dict):
    """The template(s): chat_template.jinja (and chat_templates/*.jinja, named) as
    transformers 5 saves them, else tokenizer_config.json's ``chat_template`` (a string, or
    a list of named templates)."""
    named = {p.stem: p.read_text() for p in sorted((model_dir / "chat_templates").glob("*.jinja"))}
    main = model_dir / "chat_template.jinja"
    if main.is_file():
        if not named:
            return main.read_text()
        named["default"] = main.read_text()
        return named
    if named:
        return named
    template = config.get("chat_template")
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template}
    return template


_COMPILED: dict[str, object] = {}


def _compiled(source: str):
    """The template compiled as transformers compiles it (sandboxed, trim_blocks,
    lstrip_blocks, loop controls, its globals and tojson), cached."""
    if source in _COMPILED:
        return _COMPILED[source]

    class Generation(Extension):
        """transformers' {% generation %} block (it marks assistant tokens for training
        masks); here its body renders as it is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)  # fmt: skip

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    _COMPILED[source] = env.from_string(source)
    return _COMPILED[source]


def _cut_after_final_message(rendered: str, final: dict) -> str:
    """The rendering up to the end of the final message's content (so the model continues
    it), as transformers cuts it."""
    content = final.get("content", "")
    if isinstance(content, list):
        texts = [part["text"] for part in content if part.get("type") == "text"]
        content = texts[-1] if texts else ""
    if content.strip() not in rendered:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the chat "
            "after applying the chat template! This can happen if the chat template deletes "
            "portions of the final message. Please verify the chat template and final message "
            "in your chat to ensure they are compatible."
        )
    where = rendered.rindex(content.strip())
    if rendered[where : where + len(content.lstrip())] == content:
        return rendered[: where + len(content.lstrip())]
    return rendered[: where + len(content.strip())]


def _clean_up(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and contractions."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                          (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                          (" 're", "'re")):  # fmt: skip
        text = text.replace(before, after)
    return text
