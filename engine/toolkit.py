"""The engine as the tooling (``tooling/``: bench, train, tune, export) sees it.

The runtime never imports the tooling; the tooling imports the engine only from here or from
``engine`` itself (a test over the import graph holds both). Each group below says why the
tooling needs its names: a name moves in here deliberately, as part of the surface a change in
the engine must keep working, and everything else in the engine may change without a look at
the tooling. Like ``engine``, the names resolve when first used, so that ``specserve --help``
does not import torch.
"""

from engine.lazy_exports import lazy_exports

_GROUPS: dict[str, dict[str, str]] = {
    # Running a model as a user does: the offline API, its configuration and the model files.
    "running": {
        "LLM": "engine.llm",
        "SamplingParams": "engine.sampling_params",
        "SpeculativeOptions": "engine.speculative_options",  # a request's choice of decoder
        "EngineConfig": "engine.config",
        "DecoderConfig": "engine.config",
        "ConstraintSpec": "engine.constraints",
        "load_tokenizer": "engine.tokenizer_files",
        "eos_token_ids_of": "engine.engine",
        "resolve_model": "engine.models.pull",
        "cache_dir": "engine.models.pull",
        "find_gguf": "engine.models.gguf_weights",
        "load_model": "engine.models.loader",
        "load_hf_model": "engine.models.loader",
    },
    # The decoder registry: which decoders exist, which are trained, their bench variants.
    "registry": {
        "DECODERS": "engine.decoder_registry",
        "decoder_spec": "engine.decoder_registry",
        "trained_decoders": "engine.decoder_registry",
        "LayerSkipConfig": "engine.decoder_registry",
    },
    # Drafters: training builds the networks the engine drafts with and writes the files it
    # loads (ours and the public layouts), so both sides share one definition of each.
    "drafters": {
        "EagleNetwork": "engine.decoders.eagle",
        "Eagle3Network": "engine.decoders.eagle3",
        "default_feature_layers": "engine.decoders.eagle3",
        "MedusaHeads": "engine.decoders.medusa",
        "HydraHeads": "engine.decoders.hydra",
        "KangarooAdapter": "engine.decoders.kangaroo",
        "rank_tree": "engine.decoders.trained_heads",
        "TrainedDrafter": "engine.decoders.drafter_files",
        "target_signature": "engine.decoders.drafter_files",
        "load_drafter": "engine.decoders.drafter_loading",
        "export_drafter": "engine.decoders.public_drafters",
    },
    # Teacher-forced passes: the target's hidden states along whole conversations (drafter
    # training) and single forward passes (benches), through the model's own paged attention.
    "model passes": {
        "KVCache": "engine.kv_cache",
        "SequenceSlice": "engine.attention",
        "build_attention_metadata": "engine.attention",
        "ForwardItem": "engine.model_runner",
        "rms_norm": "engine.models.llama",
        "dense_weight": "engine.models.linear",
    },
    # Measuring: speculation's statistics, the kernels and thread counts the benches and the
    # autotuner compare, the constraint compiler the constraint bench times.
    "measuring": {
        "SpecDecodeStats": "engine.speculation",
        "ThreadGovernor": "engine.thread_governor",
        "cpu_identity": "engine.models.autotune",
        "measure_group": "engine.models.autotune",
        "quantized_groups": "engine.models.autotune",
        "ONEDNN_BATCH_HINT": "engine.models.linear",
        "onednn_available": "engine.models.linear",
        "ConstraintFactory": "engine.constraints.state",
        # The products by name, and the 8-bit-activation ones the int8 bench compares.
        "product_by_name": "engine.models.products",
        "int8_isas": "engine.models.int8_activations",
        "int8_packed": "engine.models.int8_activations",
        "int8_unsupported": "engine.models.int8_activations",
        # The goodput policy, driven step by step in a simulated machine.
        "GoodputPolicy": "engine.draft_policy",
        "StepTimings": "engine.draft_policy",
        # Prompt lookup as ``ngram`` drafts, replayed beside a global suffix index.
        "find_continuation": "engine.decoders.ngram",
    },
}

# A name exported under another name than the engine's own.
_RENAMED = {
    "export_drafter": "export",
    "int8_packed": "packed",
    "int8_unsupported": "unsupported_reason",
}

EXPORTS: dict[str, str] = {name: m for group in _GROUPS.values() for name, m in group.items()}
__all__ = sorted(EXPORTS)

__getattr__ = lazy_exports("engine.toolkit", EXPORTS, _RENAMED)
