"""Speculative decoders, one file each, selected by ``decoder.method`` in the config."""

from engine.config import DecoderConfig
from engine.decoders.base import Decoder, Proposal, SpeculativeOptions
from engine.decoders.ngram import NgramDecoder

DECODERS = ("autoregressive", "ngram")


def build_decoder(config: DecoderConfig) -> Decoder:
    if config.method == "ngram":
        return NgramDecoder(config.prompt_lookup_min, config.prompt_lookup_max)
    return Decoder()


__all__ = [
    "DECODERS",
    "Decoder",
    "NgramDecoder",
    "Proposal",
    "SpeculativeOptions",
    "build_decoder",
]
