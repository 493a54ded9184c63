"""Decoder configuration: bad choices fail at load with a message that says what to do."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig


def test_layerskip_without_a_skip_set_is_refused():
    with pytest.raises(ValueError, match="layerskip needs .*specserve tune layerskip"):
        EngineConfig.from_dict({"decoder": {"method": "layerskip"}})
    with pytest.raises(ValueError, match="layerskip needs"):
        EngineConfig.from_dict({"decoder": {"extra_methods": ["layerskip"]}})
    ok = EngineConfig.from_dict(
        {"decoder": {"method": "layerskip", "layerskip": {"exit_layer": 1}}}
    )
    assert ok.decoder.methods == ["layerskip"]


def test_unknown_decoder_and_options_name_the_key():
    with pytest.raises(ValueError, match="decoder.method"):
        EngineConfig.from_dict({"decoder": {"method": "medusa2"}})
    with pytest.raises(ValueError, match="unknown config key 'decoder.window.polcy'"):
        EngineConfig.from_dict({"decoder": {"window": {"polcy": "entropy"}}})
    with pytest.raises(ValueError, match="decoder.draft.quantization"):
        EngineConfig.from_dict({"decoder": {"draft": {"quantization": "int3"}}})


def test_methods_lists_the_default_first_and_each_once():
    config = EngineConfig.from_dict(
        {"decoder": {"method": "ngram", "extra_methods": ["draft", "ngram", "draft"]}}
    )
    assert config.decoder.methods == ["ngram", "draft"]


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_model_dir, tmp_path):
    from engine import LLM
    from tests.tiny_models import save_tiny_model

    other = save_tiny_model(tmp_path / "other", vocab_size=300)
    decoder = {"method": "draft", "draft": {"model": str(other), "quantization": "none"}}
    with pytest.raises(ValueError, match="must share the tokenizer"):
        LLM(config=EngineConfig(model=str(tiny_model_dir), decoder=decoder))


def test_layer_ids_out_of_range_are_refused(tiny_model_dir):
    from engine import LLM

    decoder = {"method": "layerskip", "layerskip": {"skip_mlp": [7]}}
    with pytest.raises(ValueError, match=r"layerskip.skip_mlp: layers \[7\] are not in \[0, 3\)"):
        LLM(config=EngineConfig(model=str(tiny_model_dir), decoder=decoder))
    decoder = {"method": "layerskip", "layerskip": {"exit_layer": 2}}
    with pytest.raises(ValueError, match="exit_layer must be below 2"):
        LLM(config=EngineConfig(model=str(tiny_model_dir), decoder=decoder))


def test_offline_api_picks_a_loaded_decoder_per_call(tiny_model_dir):
    from engine import LLM, SamplingParams
    from engine.decoders import SpeculativeOptions

    decoder = {"method": "autoregressive", "extra_methods": ["draft"]}
    llm = LLM(config=EngineConfig(model=str(tiny_model_dir), decoder=decoder))
    prompt, greedy = [5, 6, 7, 8] * 3, SamplingParams(temperature=0, max_tokens=12)
    plain = llm.generate(prompt, greedy)[0].token_ids
    stats = llm.engine.speculator.stats_by_decoder["draft"]
    assert stats.num_drafts == 0  # the default decoder does not draft
    drafted = llm.generate(prompt, greedy, SpeculativeOptions("draft"))[0].token_ids
    assert drafted == plain and stats.num_drafts > 0
    with pytest.raises(ValueError, match="'ngram' is not loaded; loaded: autoregressive, draft"):
        llm.generate(prompt, greedy, SpeculativeOptions("ngram"))
    assert not llm.engine.has_unfinished_requests()


def test_draft_self_copy_equal_to_the_target_is_refused():
    with pytest.raises(ValueError, match="is the target itself"):
        EngineConfig.from_dict({"decoder": {"method": "draft", "draft": {"quantization": "none"}}})
    with pytest.raises(ValueError, match=r"prompt_lookup_min \(3\) is above prompt_lookup_max"):
        EngineConfig.from_dict({"decoder": {"prompt_lookup_min": 3, "prompt_lookup_max": 2}})


def test_a_draft_model_with_a_shorter_context_drafts_past_it(tiny_model_dir, tmp_path):
    """The draft's rope table covers the target's context, not only the draft's own."""
    from engine import LLM, SamplingParams
    from tests.tiny_models import save_tiny_model

    short = save_tiny_model(tmp_path / "short", max_position_embeddings=32)
    decoder = {"method": "draft", "draft": {"model": str(short), "quantization": "none"}}
    llm = LLM(config=EngineConfig(model=str(tiny_model_dir), decoder=decoder))
    ar = LLM(model=str(tiny_model_dir))
    prompt, greedy = list(range(3, 43)), SamplingParams(temperature=0, max_tokens=20)
    assert len(prompt) > 32
    assert llm.generate(prompt, greedy)[0].token_ids == ar.generate(prompt, greedy)[0].token_ids
    assert llm.engine.speculator.stats.num_drafts > 0


def test_truncated_level1_reads_only_what_level2_has_cached(tiny_model_dir, tiny_draft_model_dir):
    """With a separate level-2 model, level 1 (level 2's first layers, over level 2's cache)
    must start where level 2's own K/V end, not where the target's do: on a sequence's first
    drafting step level 2 has read nothing, so level 1 reads the whole prefix."""
    from engine import LLM, SamplingParams

    decoder = {
        "method": "hierarchical",
        "draft_policy": "fixed",
        "draft": {"model": str(tiny_draft_model_dir), "quantization": "none"},
        "hierarchical": {"level1": "draft_truncated", "level1_num_layers": 1},
    }
    llm = LLM(config=EngineConfig(model=str(tiny_model_dir), decoder=decoder))
    level1 = llm.engine.speculator.decoders["hierarchical"].level1
    starts = []
    run = level1.runner.run

    def recording_run(items, **options):
        starts.extend(item.num_cached for item in items)
        return run(items, **options)

    level1.runner.run = recording_run
    llm.generate([7, 8, 9, 10, 11, 12], SamplingParams(temperature=0, max_tokens=8))
    assert starts and starts[0] == 0


def test_a_sequence_carries_decoder_options_without_importing_the_decoders():
    # engine.sequence used to reach SpeculativeOptions through engine.decoders, which imports
    # the engine's config and decoders back: an import loop waiting to close.
    import subprocess
    import sys

    code = (
        "import sys, engine.sequence, engine.speculative_options; "
        "print(any(m.startswith('engine.decoders') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_drafters_read_the_cache_through_cache_state_only():
    # The scheduler's field names stay the scheduler's: decoders see CacheState.
    import re
    from pathlib import Path

    import engine.decoders
    from engine.sampling import SamplingParams
    from engine.sequence import CacheState, Sequence

    seq = Sequence("s", "r", [1, 2, 3], SamplingParams(), None)
    seq.num_computed_tokens, seq.block_table, seq.num_preemptions = 2, [7], 1
    assert seq.cache_state() == CacheState(num_cached=2, block_table=[7], epoch=1)
    # Sequence fields read by name (not CacheState's: cache_state().block_table is fine).
    scheduler_fields = re.compile(r"num_computed_tokens|num_preemptions|[A-Za-z_]\.block_table")
    for path in Path(engine.decoders.__file__).parent.glob("*.py"):
        assert not scheduler_fields.findall(path.read_text()), path.name


def test_device_names_are_checked():
    from engine.config import EngineConfig

    for device in ("cpu", "cuda", "cuda:1"):
        assert EngineConfig(device=device).device == device
    for device in ("gpu", "cpu:0", "cuda:x", "cuda:"):
        with pytest.raises(ValueError, match="expected cpu, cuda or cuda:N"):
            EngineConfig.from_dict({"device": device})


def test_gpu_kv_cache_budget_follows_vllm_utilization_rule():
    from engine.kv_cache.sizing import GPU_HEADROOM_BYTES, gpu_kv_cache_bytes

    gib = 2**30
    assert gpu_kv_cache_bytes(80 * gib, 1 * gib, 0.9) == int(72 * gib) - gib - GPU_HEADROOM_BYTES
    with pytest.raises(ValueError, match="leaves no room for a KV cache"):
        gpu_kv_cache_bytes(80 * gib, 70 * gib, 0.9)


def test_the_step_stretch_bound_comes_from_the_command_line_or_stays_off():
    from server.cli_generate import engine_config_from_args
    from tooling.cli import build_parser

    parser = build_parser()
    bounded = engine_config_from_args(parser.parse_args(["serve", "--max-step-stretch", "1.2"]))
    assert bounded.decoder.max_step_stretch == 1.2
    assert engine_config_from_args(parser.parse_args(["serve"])).decoder.max_step_stretch is None
    with pytest.raises(ValueError, match="max_step_stretch"):
        EngineConfig().with_overrides(decoder={"max_step_stretch": 0.9})  # shorter than plain


def test_drafter_names_the_trained_decoder_s_drafter_and_hybrid_s():
    from server.cli_generate import engine_config_from_args
    from tooling.cli import build_parser

    parser = build_parser()
    args = ["serve", "--decoder", "hydra", "--drafter", "my-heads"]
    assert engine_config_from_args(parser.parse_args(args)).decoder.hydra.drafter == "my-heads"
    # hybrid drafts with hydra's heads (hybrid.drafter): --drafter names those
    args = ["serve", "--decoder", "hybrid", "--drafter", "my-heads"]
    assert engine_config_from_args(parser.parse_args(args)).decoder.hydra.drafter == "my-heads"
    ngram = parser.parse_args(["serve", "--decoder", "ngram", "--drafter", "x"])
    with pytest.raises(ValueError, match="--drafter needs --decoder .*hybrid"):
        engine_config_from_args(ngram)
