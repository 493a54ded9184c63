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
