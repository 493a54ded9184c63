"""One registration makes a decoder: a toy decoder registered in one place is found by config
validation, the command line, the engine's builder, the server's method check and the bench."""

from __future__ import annotations

import pytest
from pydantic import Field

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.decoder_registry import (
    DECODERS,
    DecoderSpec,
    Strict,
    register,
    trained_decoders,
    unregister,
)
from engine.decoders.ngram import NgramDecoder
from engine.speculative_options import SpeculativeOptions


class ToyConfig(Strict):
    longest: int = Field(3, ge=1)


def build_toy(config, target):
    """Prompt lookup under another name, configured by its own section."""
    return NgramDecoder(1, config.section("toy").longest)


@pytest.fixture
def toy():
    spec = register(
        DecoderSpec(
            "toy",
            f"{__name__}:build_toy",
            "a toy decoder for the registry test",
            section=ToyConfig,
            bench={"toy-k2": {"method": "toy", "num_speculative_tokens": 2}},
        )
    )
    yield spec
    unregister("toy")


def test_config_validation_knows_the_toy_and_its_section(toy):
    config = EngineConfig().with_overrides(decoder={"method": "toy", "toy": {"longest": 2}})
    assert config.decoder.method == "toy" and config.decoder.toy.longest == 2
    assert EngineConfig().decoder.toy.longest == 3  # the section's defaults when absent
    with pytest.raises(ValueError, match="unknown config key 'decoder.toy.longst'"):
        EngineConfig().with_overrides(decoder={"toy": {"longst": 2}})
    with pytest.raises(ValueError, match="decoder.toy.longest"):
        EngineConfig().with_overrides(decoder={"toy": {"longest": 0}})


def test_without_the_registration_the_name_and_section_are_unknown():
    assert "toy" not in DECODERS
    with pytest.raises(ValueError, match="unknown decoder 'toy'; known: autoregressive, ngram"):
        EngineConfig().with_overrides(decoder={"method": "toy"})
    with pytest.raises(ValueError, match="unknown config key 'decoder.toy'"):
        EngineConfig().with_overrides(decoder={"toy": {}})


def test_the_command_line_offers_the_toy(toy):
    from server.cli_generate import engine_config_from_args
    from tooling.cli import build_parser

    args = build_parser().parse_args(["serve", "--decoder", "toy"])
    assert engine_config_from_args(args).decoder.method == "toy"
    with pytest.raises(SystemExit):  # argparse's own error for a choice it does not offer
        build_parser().parse_args(["serve", "--decoder", "tyo"])


def test_the_engine_builds_the_toy_and_it_decodes_like_autoregressive(toy, tiny_model_dir):
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    llm = LLM(model=str(tiny_model_dir), decoder={"method": "toy", "draft_policy": "fixed"})
    plain = llm.generate([prompt], greedy, speculative=SpeculativeOptions("autoregressive"))
    assert "toy" in llm.engine.loaded_decoders
    assert llm.generate([prompt], greedy)[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


def test_the_servers_method_check_tells_unknown_from_not_loaded(toy):
    from types import SimpleNamespace

    from server.errors import APIError
    from server.handlers import _speculative

    state = SimpleNamespace(client=SimpleNamespace(info=SimpleNamespace(decoders=["ngram"])))

    def ask(method):
        return _speculative(state, SimpleNamespace(speculative=SimpleNamespace(
            method=method, num_speculative_tokens=None)))  # fmt: skip

    with pytest.raises(APIError, match="'toy' is not loaded; loaded: ngram"):
        ask("toy")
    with pytest.raises(APIError, match="unknown speculative method 'tyo'; known: .*toy"):
        ask("tyo")
    assert ask("ngram") == SpeculativeOptions("ngram")


def test_the_bench_measures_the_toys_variants(toy):
    from tooling.bench.bench_decoders import all_variants

    names = [v.name for v in all_variants(num_layers=3)]
    assert "toy-k2" in names and "eagle" in names and "draft-int8-2layers" in names


def test_every_trained_decoder_has_a_trainer():
    from tooling.cli import build_parser

    train = build_parser()._subparsers._group_actions[0].choices["train"]
    kinds = train._subparsers._group_actions[0].choices
    assert set(trained_decoders()) <= set(kinds)
