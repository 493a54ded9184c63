"""Speculative decoders, one file each, selected by ``decoder.method`` in the config (and per
request among ``decoder.extra_methods``)."""

from engine.config import DecoderConfig
from engine.decoder_registry import DECODERS, decoder_spec
from engine.decoders.base import Decoder, Proposal, TargetContext
from engine.decoders.ngram import NgramDecoder
from engine.speculative_options import SpeculativeOptions


def build_decoder(name: str, config: DecoderConfig, target: TargetContext) -> Decoder:
    """The decoder called ``name``, configured by ``config``, built by its registered builder
    (engine/decoder_registry.py)."""
    spec = decoder_spec(name)
    if spec.build is None:  # autoregressive: nothing to draft
        return Decoder()
    decoder = spec.builder()(config, target)
    decoder.name = name  # statistics and requests know it by its registered name
    return decoder


__all__ = [
    "DECODERS",
    "Decoder",
    "NgramDecoder",
    "Proposal",
    "SpeculativeOptions",
    "TargetContext",
    "build_decoder",
]
