"""``layerskip``: self-speculative decoding with the target's own layers (Draft & Verify,
Zhang et al. 2023; LayerSkip's early exit, Elhoushi et al. 2024).

The draft is the target run with some attention and MLP sublayers skipped, or cut after
``exit_layer`` (then the final norm and LM head). It reads the target's KV cache for the
verified context and writes approximate K/V only for the layers it runs, into slots the
verification pass rewrites. ``specserve tune layerskip`` searches the skip set.

With no skip set configured the draft would be the target itself: that is refused, since
it can only lose.
"""

from __future__ import annotations

from engine.config import DecoderConfig
from engine.decoders.base import TargetContext
from engine.decoders.drafting import ModelDrafter
from engine.decoders.model_draft import ModelDraftDecoder
from engine.decoders.windows import build_window
from engine.model_runner import ModelRunner


def layerskip_options(config: DecoderConfig, num_layers: int) -> dict:
    """The model-forward options of the configured draft (validated against the model)."""
    spec = config.layerskip
    for name, layers in (("skip_attention", spec.skip_attention), ("skip_mlp", spec.skip_mlp)):
        bad = [i for i in layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"layerskip.{name}: layers {bad} are not in [0, {num_layers})")
    if spec.exit_layer is not None and spec.exit_layer >= num_layers - 1:
        raise ValueError(f"layerskip.exit_layer must be below {num_layers - 1} (the last layer)")
    if not (spec.skip_attention or spec.skip_mlp or spec.exit_layer is not None):
        raise ValueError(
            "layerskip needs skip_attention, skip_mlp or exit_layer (the draft would be the "
            "target itself); `specserve tune layerskip` searches for them"
        )
    last = num_layers - 1 if spec.exit_layer is None else spec.exit_layer
    return {
        "layer_ids": range(last + 1),
        "skip_attention": frozenset(spec.skip_attention),
        "skip_mlp": frozenset(spec.skip_mlp),
    }


def build_layerskip_decoder(config: DecoderConfig, target: TargetContext) -> ModelDraftDecoder:
    options = layerskip_options(config, target.model.arch.num_layers)
    runner = ModelRunner(target.model, target.kv_cache, target.device)
    drafter = ModelDrafter(runner, target.eos_token_ids, build_window(config.window), True, options)
    return ModelDraftDecoder("layerskip", drafter)
