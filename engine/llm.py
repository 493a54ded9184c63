"""The offline API: ``LLM(...).generate(...)`` and ``.chat(...)`` on top of ``Engine``."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.engine import create_engine
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling import SamplingParams
from engine.speculative_options import SpeculativeOptions
from engine.tokenizer_files import load_tokenizer

Prompt = str | Sequence[int]


class LLM:
    """Offline generation with the engine, for scripts and our own checks.

    ``LLM(model="smollm2-135m-instruct")``, ``LLM(config="configs/default.yaml")``, or both
    (the model overrides the file's); further keyword arguments override config fields,
    e.g. ``kv_cache={"num_blocks": 64}``.
    """

    def __init__(
        self,
        model: str | None = None,
        config: str | Path | EngineConfig | None = None,
        **overrides: Any,
    ):
        if isinstance(config, (str, Path)):
            config = EngineConfig.from_yaml(config)
        config = config or EngineConfig()
        if model is not None:
            overrides["model"] = model
        self.config = config.with_overrides(**overrides) if overrides else config
        self.engine, self.model_dir = create_engine(self.config)
        self.tokenizer = load_tokenizer(self.model_dir)
        self._ids = itertools.count()

    # ---- public API --------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        speculative: SpeculativeOptions | None = None,
        return_hidden_states: bool | tuple[int, ...] = False,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, or a list of token ids); outputs in prompt order.

        ``speculative`` picks one of the loaded decoders (``engine.loaded_decoders``) for these
        prompts, as the server's ``"speculative"`` field does; None uses the configured one.
        ``return_hidden_states`` hands back the target's last-layer hidden states along each
        output, or with a tuple of layer indices those layers' outputs side by side
        (``CompletionOutput.hidden_states``; autoregressive decoding only)."""
        if isinstance(prompts, str) or _is_token_list(prompts):
            prompts = [prompts]
        token_lists = [self._encode(p) for p in prompts]
        params = self._params_per_prompt(sampling_params, len(token_lists))
        for tokens, p in zip(token_lists, params, strict=True):
            self.engine.validate_prompt(tokens, p)  # all checked before any is queued
        self._check_decoder(speculative)
        if return_hidden_states is not False:
            self.engine.validate_hidden_capture(speculative)
        request_ids = []
        for tokens, p in zip(token_lists, params, strict=True):
            request_ids.append(f"offline-{next(self._ids)}")
            self.engine.add_request(request_ids[-1], tokens, p, speculative, return_hidden_states)
        finished: dict[str, RequestOutput] = {}
        try:
            while len(finished) < len(request_ids):
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
        finally:
            for rid in request_ids:
                self.engine.abort(rid)  # no-op for finished requests; frees on error
        return [self._with_text(finished[rid]) for rid in request_ids]

    def chat(
        self,
        conversations: Sequence[Sequence[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        speculative: SpeculativeOptions | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # a single conversation
        prompts = [self.render_chat(c) for c in conversations]
        return self.generate(prompts, sampling_params, speculative)

    def stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams,
        speculative: SpeculativeOptions | None = None,
    ) -> Iterator[str]:
        """Yield the text of one prompt's first continuation as it is generated (pieces
        that concatenate to ``generate``'s text; nothing for a model without tokenizer)."""
        tokens = self._encode(prompt)
        request_id = f"offline-{next(self._ids)}"
        self.engine.add_request(request_id, tokens, sampling_params, speculative)
        # Each step decodes only its new tokens (with a few before them for context).
        text = None
        if self.tokenizer is not None:
            text = IncrementalDetokenizer(
                self.tokenizer, tokens, stop_token_ids=sampling_params.stop_token_ids
            )
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    completion = out.outputs[0]
                    if text is None:
                        continue
                    piece = text.push(completion.new_token_ids).text
                    if completion.finished:
                        # A stop token or EOS ended it: its text is not shown (as generate).
                        piece += text.finish(drop_last_token=completion.finish_reason == "stop")
                    if piece:
                        yield piece
        finally:
            self.engine.abort(request_id)

    def render_chat(self, conversation: Sequence[dict[str, str]]) -> list[int]:
        tokenizer = self._require_tokenizer()
        text = tokenizer.apply_chat_template(
            list(conversation), tokenize=False, add_generation_prompt=True
        )
        return tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of token ids, special tokens skipped ("" for a model without tokenizer)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    # ---- helpers -----------------------------------------------------------------------
    def _check_decoder(self, speculative: SpeculativeOptions | None) -> None:
        loaded = self.engine.loaded_decoders
        if speculative is not None and speculative.method not in loaded:
            raise ValueError(
                f"speculative method {speculative.method!r} is not loaded; "
                f"loaded: {', '.join(loaded)}"
            )

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: at least one token is required")
            return self._require_tokenizer().encode(prompt)
        return [int(t) for t in prompt]

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"{self.model_dir} has no tokenizer: pass token ids instead of text")
        return self.tokenizer

    @staticmethod
    def _params_per_prompt(params, count: int) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            return [params] * count
        if len(params) != count:
            raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
        return list(params)

    def visible_text(self, completion: CompletionOutput) -> str:
        """A completion's text: without a final stop or EOS token, as OpenAI/vLLM show it."""
        ids = completion.token_ids
        if completion.finish_reason == "stop" and ids:
            ids = ids[:-1]  # the stop/EOS token is kept in token_ids, not in text
        return self.decode(ids)

    def _with_text(self, out: RequestOutput) -> RequestOutput:
        for completion in out.outputs:
            completion.text = self.visible_text(completion)
        return out


def _is_token_list(prompt: Any) -> bool:
    return isinstance(prompt, Sequence) and bool(prompt) and isinstance(prompt[0], int)
