"""``draft``: classic speculative decoding with a draft model (Leviathan et al. 2023, Chen et
al. 2023; Hugging Face's ``assistant_model``).

The draft model is either a separate model that shares the target's tokenizer (any model the
loader takes), with its own paged KV cache over the target's block tables, or ``"self"``: a
cheaper copy of the target itself (weight-only int8 or bfloat16 projections, optionally only
its first layers), which reads and writes the target's own cache. Drafts are sampled from the
draft's processed distribution q and verified with the general rejection rule.
"""

from __future__ import annotations

from engine.config import DecoderConfig
from engine.decoders.base import TargetContext
from engine.decoders.drafting import ModelDrafter
from engine.decoders.model_draft import ModelDraftDecoder
from engine.decoders.windows import build_window
from engine.kv_cache import KVCache
from engine.model_runner import ModelRunner
from engine.models.draft_copies import draft_copy
from engine.models.loader import load_model
from engine.models.pull import resolve_model


def load_draft_model(config: DecoderConfig, target: TargetContext):
    """The configured draft model and whether it reads the target's cache."""
    spec = config.draft
    if spec.model == "self":
        return draft_copy(target.model, spec.quantization, spec.num_layers), True

    # Its rope table must cover the target's context, even past its own trained length.
    model, _ = load_model(
        resolve_model(spec.model), target.model.dtype, target.device, target.max_model_len
    )
    if model.arch.vocab_size != target.model.arch.vocab_size:
        raise ValueError(
            f"draft model {spec.model!r} has a vocabulary of {model.arch.vocab_size} tokens, "
            f"the target {target.model.arch.vocab_size}: the draft must share the tokenizer"
        )
    if spec.quantization != "none" or spec.num_layers is not None:
        model = draft_copy(model, spec.quantization, spec.num_layers)
    return model, False


def draft_kv_cache(model, shares_target_cache: bool, target: TargetContext) -> KVCache:
    """The target's cache for a self draft; for a separate model, its own tensors over the
    same blocks, so the target's allocation, rollback and freeing cover it too."""
    if shares_target_cache:
        return target.kv_cache
    arch, cache = model.arch, target.kv_cache
    return KVCache(
        len(model.layers),
        cache.num_blocks,
        cache.block_size,
        arch.num_kv_heads,
        arch.head_dim,
        model.dtype,
        target.device,
        scratch_blocks=cache.scratch_blocks,
    )


def build_draft_decoder(config: DecoderConfig, target: TargetContext) -> ModelDraftDecoder:
    model, shares = load_draft_model(config, target)
    runner = ModelRunner(model, draft_kv_cache(model, shares, target), target.device)
    drafter = ModelDrafter(runner, target.eos_token_ids, build_window(config.window), shares)
    return ModelDraftDecoder("draft", drafter)
