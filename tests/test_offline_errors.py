"""Bad input to the offline API raises a clear error and leaves the engine usable."""

from __future__ import annotations

import pytest

from engine import LLM, EngineConfig, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), scheduler={"max_model_len": 128})


@pytest.mark.parametrize(
    "prompt,params,message",
    [
        ([], SamplingParams(), "prompt is empty"),
        ([5] * 128, SamplingParams(), "context length is 128"),
        ([5] * 100, SamplingParams(max_tokens=40), "prompt (100 tokens) plus max_tokens (40)"),
        ([5, 100000], SamplingParams(), "prompt token ids must be in [0, 320)"),
        ([5], SamplingParams(stop_token_ids=[320]), "stop_token_ids"),
    ],
    ids=[
        "empty",
        "longer-than-context",
        "prompt-plus-max-tokens",
        "token-out-of-vocab",
        "stop-token-out-of-vocab",
    ],
)
def test_bad_prompt_raises_and_engine_stays_clean(llm, prompt, params, message):
    with pytest.raises(ValueError) as excinfo:
        llm.generate([[7, 8], prompt], params)
    assert message in str(excinfo.value)
    # Nothing was queued: not even the valid prompt before the bad one.
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    assert llm.generate([[7, 8]], SamplingParams(max_tokens=3))[0].finish_reason is not None


def test_empty_text_prompt_is_an_error(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate("", SamplingParams())


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_sampling_params_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_unknown_model_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        LLM(model="no-such-model")


def test_unknown_config_key_names_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: x\nkv_cache:\n  blok_size: 16\n")
    with pytest.raises(ValueError, match="unknown config key 'kv_cache.blok_size'"):
        EngineConfig.from_yaml(path)
    with pytest.raises(ValueError, match="unknown config key 'speculative'"):
        LLM(config=EngineConfig(), speculative=True)


def test_default_config_file_is_the_built_in_default():
    # The CLI falls back to EngineConfig() when no --config is given: they must agree.
    assert EngineConfig.from_yaml("configs/default.yaml") == EngineConfig()
    assert EngineConfig().model == "smollm2-135m-instruct"


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        EngineConfig.from_yaml(tmp_path / "nope.yaml")


def test_kv_cache_too_small_for_the_context_is_rejected(tiny_model_dir):
    with pytest.raises(ValueError, match="less than max_model_len 512"):
        LLM(model=str(tiny_model_dir), kv_cache={"num_blocks": 4})
