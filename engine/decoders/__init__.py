"""Speculative decoders, one file each, selected by ``decoder.method`` in the config (and per
request among ``decoder.extra_methods``)."""

from engine.config import DecoderConfig
from engine.decoders.base import Decoder, Proposal, TargetContext
from engine.decoders.ngram import NgramDecoder
from engine.speculative_options import SpeculativeOptions

DECODERS = (
    "autoregressive",
    "ngram",
    "draft",
    "layerskip",
    "hierarchical",
    "medusa",
    "hydra",
    "eagle",
    "kangaroo",
)


def build_decoder(name: str, config: DecoderConfig, target: TargetContext) -> Decoder:
    """The decoder called ``name``, configured by ``config``."""
    if name == "ngram":
        return NgramDecoder(
            config.prompt_lookup_min, config.prompt_lookup_max, config.prompt_lookup_candidates
        )
    if name == "draft":
        from engine.decoders.draft import build_draft_decoder

        return build_draft_decoder(config, target)
    if name == "layerskip":
        from engine.decoders.layerskip import build_layerskip_decoder

        return build_layerskip_decoder(config, target)
    if name == "hierarchical":
        from engine.decoders.hierarchical import HierarchicalDecoder

        return HierarchicalDecoder(config, target)
    if name == "medusa":
        from engine.decoders.medusa import build_medusa_decoder

        return build_medusa_decoder(config, target)
    if name == "hydra":
        from engine.decoders.hydra import build_hydra_decoder

        return build_hydra_decoder(config, target)
    if name == "eagle":
        from engine.decoders.eagle import build_eagle_decoder

        return build_eagle_decoder(config, target)
    if name == "kangaroo":
        from engine.decoders.kangaroo import build_kangaroo_decoder

        return build_kangaroo_decoder(config, target)
    if name == "autoregressive":
        return Decoder()
    raise ValueError(f"unknown decoder {name!r}; known: {', '.join(DECODERS)}")


__all__ = [
    "DECODERS",
    "Decoder",
    "NgramDecoder",
    "Proposal",
    "SpeculativeOptions",
    "TargetContext",
    "build_decoder",
]
