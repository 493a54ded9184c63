"""``specserve tune layerskip`` on a tiny random Llama: the search, its honesty, the config."""

from __future__ import annotations

import shutil
import subprocess
import sys

import optuna
import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from tooling.bench.tune_layerskip import (
    GreedyMismatchError,
    LayerSkipTuner,
    SkipSet,
    TuneOptions,
    run_tune_layerskip,
    suggest_skip_set,
    tune_layerskip,
    tuning_llm,
    verdict,
)

PROMPTS = [[5, 17, 42, 99, 7, 250, 31], [3, 8, 100, 200, 31, 64], [11, 12, 13, 14, 15]]
SPECSERVE = [sys.executable, "-m", "tooling.cli"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A tiny model gains nothing from more threads, and loses much on a busy machine; the
    engines here set 1 (``num_threads``), and the other modules get torch's setting back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def tiny_config(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), num_threads=1, kv_cache={"num_blocks": 64})


@pytest.fixture(scope="module")
def tuner(tiny_model_dir) -> LayerSkipTuner:
    return LayerSkipTuner(tuning_llm(tiny_config(tiny_model_dir)), PROMPTS, max_tokens=12)


@pytest.fixture(scope="module")
def tiny_chat_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a byte-level tokenizer (ids 3..258) and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tune") / "tiny-chat"
    shutil.copytree(tiny_model_dir, path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {ch: 3 + i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    fast.save_pretrained(path)
    return path


def test_search_measures_valid_skip_sets_with_greedy_identical_tokens(tuner):
    result = tune_layerskip(tuner, num_trials=6, seed=1, confirm_top=2, log=lambda _: None)
    assert len(result.trials) == 6  # measured ones; pruned (empty) drafts do not count
    layers = tuner.num_layers
    for t in result.trials:
        s, draft = t.skip_set, t.study.draft
        assert not s.is_empty and 1 <= s.num_speculative_tokens <= 6
        assert all(0 <= i < layers for i in (*s.skip_attention, *s.skip_mlp))
        assert draft.token_ids == t.study.autoregressive.token_ids == tuner.reference
        assert 0 <= draft.acceptance_rate <= 1 and draft.mean_acceptance_length >= 1
    speedups = [t.study.speedup for t in result.trials]
    assert speedups == sorted(speedups, reverse=True)
    assert 1 <= len(result.confirmed) <= 2 and result.best is result.confirmed[0]
    best = result.best.confirmation
    assert best.draft.token_ids == tuner.reference
    assert result.speedup == best.draft.tokens_per_s / best.autoregressive.tokens_per_s


def test_search_is_reproducible_given_the_seed_up_to_tpe(tuner):
    # The start-up trials (numbers 0-2 with 3 to measure) are random draws from the seed;
    # a trial after them follows the timings (when a start-up draw skipped nothing and was
    # pruned), so only the start-up ones are compared.
    def first_skip_sets(seed):
        result = tune_layerskip(tuner, 3, seed=seed, confirm_top=0, log=lambda _: None)
        return {t.number: t.skip_set for t in result.trials if t.number < 3}

    first = first_skip_sets(7)
    assert first and first == first_skip_sets(7)


def test_no_draft_beating_autoregressive_is_reported_honestly(tuner):
    result = tune_layerskip(
        tuner, num_trials=3, seed=0, confirm_top=1, min_speedup=1e9, log=lambda _: None
    )
    assert result.best is not None and not result.beats_autoregressive
    line = verdict(result)
    assert line.startswith("no skip set beat autoregressive by more than")
    assert f"= {result.speedup:.2f}x" in line


def test_a_draft_changing_greedy_tokens_stops_the_run(tuner, monkeypatch):
    import tooling.bench.tune_layerskip as tune

    def measure_set_with_a_wrong_draft(*args):
        results = measure_set(*args)
        results[0].token_ids[1] = results[0].token_ids[1][:3] + [4, 4]  # fault: draft 0
        return results

    measure_set = tune.measure_set
    monkeypatch.setattr(tune, "measure_set", measure_set_with_a_wrong_draft)
    with pytest.raises(GreedyMismatchError, match=r"layerskip \(attn -, mlp 1, k=2\) differs"):
        tuner.compare([SkipSet((), (1,), None, 2)])
    with pytest.raises(GreedyMismatchError, match="on calibration prompt 1 at generated token 3"):
        tuner.compare([SkipSet((), (1,), None, 2)])


def test_skip_spans_are_clipped_and_an_empty_draft_is_recognised():
    params = {
        "attention_count_plus_1": 3,  # two layers from layer 1: 1, 2
        "attention_first": 1,
        "mlp_count_plus_1": 1,  # none
        "mlp_first": 0,
        "num_speculative_tokens": 2,
    }
    spans = suggest_skip_set(optuna.trial.FixedTrial(params), 3, (1, 6), early_exit=False)
    assert spans == SkipSet((1, 2), (), None, 2)
    cut = suggest_skip_set(
        optuna.trial.FixedTrial({**params, "layers_cut": 1}), 3, (1, 6), early_exit=True
    )
    assert cut == SkipSet((1,), (), 1, 2)  # exit after layer 1; layer 2's skip is moot
    none = {**params, "attention_count_plus_1": 1}
    assert suggest_skip_set(optuna.trial.FixedTrial(none), 3, (1, 6), False).is_empty


def test_winning_draft_is_written_as_a_loadable_config(tiny_chat_dir, tmp_path, capsys):
    output = tmp_path / "tuned.yaml"
    options = TuneOptions(
        num_prompts=1, max_tokens=6, num_trials=4, confirm_top=1, min_speedup=0.0, output=output
    )
    result = run_tune_layerskip(tiny_config(tiny_chat_dir), options)
    out = capsys.readouterr().out
    assert "calibration: 2 prompts (chat,grounded)" in out and "| trial | skip set |" in out
    assert f"wrote {output}" in out
    loaded = EngineConfig.from_yaml(output)
    best = result.best.skip_set
    assert loaded.decoder.method == "layerskip"
    assert loaded.decoder.layerskip.skip_attention == list(best.skip_attention)
    assert loaded.decoder.layerskip.skip_mlp == list(best.skip_mlp)
    assert loaded.decoder.num_speculative_tokens == best.num_speculative_tokens
    assert loaded.model == str(tiny_chat_dir) and loaded.kv_cache.num_blocks == 64
    assert output.read_text().startswith("# specserve tune layerskip: best skip set:")
    LLM(config=loaded)  # the decoder accepts the written draft


def test_cli_reports_no_winner_and_writes_nothing(tiny_chat_dir, tmp_path):
    output, config = tmp_path / "tuned.yaml", tmp_path / "config.yaml"
    config.write_text("num_threads: 1\n")  # a tiny model gains nothing from more
    args = ["tune", "layerskip", "--config", str(config), "--model", str(tiny_chat_dir)]
    args += ["--trials", "3"]
    args += ["--num-prompts", "1", "--max-tokens", "4", "--confirm-top", "1"]
    args += ["--min-speedup", "1000", "--output", str(output)]
    result = subprocess.run(
        [*SPECSERVE, *args], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "no skip set beat autoregressive by more than 1000.00x (best" in result.stdout
    assert "nothing written" in result.stdout and not output.exists()
    assert "| trial | skip set | tok/s | AR tok/s | vs AR |" in result.stdout
