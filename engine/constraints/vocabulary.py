"""The model's vocabulary as llguidance sees it, built once from the model's tokenizer.

Light (no torch): the API process uses it to check a request's constraint against the
vocabulary before a response starts; the engine's matchers (``ConstraintFactory``) use it too.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path

from engine.tokenizer_files import load_tokenizer


class ConstraintVocabulary:
    """The llguidance tokenizer (about 0.3 s for a 50k vocabulary), made from the model's
    tokenizer on first use."""

    def __init__(
        self,
        load_tokenizer: Callable[[], object],
        vocab_size: int,
        eos_token_ids: Collection[int],
    ):
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer = None
        self._hf_tokenizer = None

    @classmethod
    def for_model_dir(cls, model_dir: Path, vocab_size: int, eos_token_ids: Collection[int]):

        return cls(lambda: load_tokenizer(Path(model_dir)), vocab_size, eos_token_ids)

    @property
    def hf_tokenizer(self):
        if self._hf_tokenizer is None:
            self._hf_tokenizer = self._load_tokenizer()
            if self._hf_tokenizer is None:
                raise ValueError("constrained decoding needs the model's tokenizer files")
        return self._hf_tokenizer

    @property
    def tokenizer(self):
        """The llguidance tokenizer."""
        if self._tokenizer is None:
            tokenizer = self.hf_tokenizer
            if hasattr(tokenizer, "llguidance"):  # a FastTokenizer: no transformers needed
                self._tokenizer = tokenizer.llguidance(self.vocab_size, self.eos_token_ids)
            else:
                import llguidance.hf  # loaded on the first constrained request only

                self._tokenizer = llguidance.hf.from_tokenizer(
                    tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
        return self._tokenizer
