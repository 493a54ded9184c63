"""``specserve bench profile``: per-step counts from torch.profiler and the variants' runs."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tooling.bench.bench_profile import (
    ProfileOptions,
    count_events,
    python_shares,
    run_profile_bench,
)


def _interpreted(n: int) -> int:
    total = 0
    for i in range(n):
        total += i * i
    return total


def test_counts_are_per_step_and_rank_operators_by_self_time():
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(4):  # four "steps" of one product and one softmax each
            torch.mm(a, b).softmax(-1)
    calls, kernels, launches, top = count_events(prof.events(), steps=4, top=3)
    assert calls == 2  # mm and softmax, called from Python; their inner calls are not counted
    assert kernels == 0 and launches == 0  # no device here
    by_name = {op.name: op for op in top}
    assert by_name["aten::mm"].calls == 1
    assert len(top) == 3
    assert [op.self_cpu_us for op in top] == sorted((op.self_cpu_us for op in top), reverse=True)


def test_python_shares_are_per_step_with_the_interpreter_s_own_time():
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(4):  # four "steps": one interpreted loop and one built-in sort each
        _interpreted(20000)
        sorted(range(20000), reverse=True)
    profiler.disable()
    interpreted_us, top = python_shares(pstats.Stats(profiler), steps=4, top=3)
    by_name = {f.name: f for f in top}
    loop = next(f for name, f in by_name.items() if name.endswith("(_interpreted)"))
    assert loop.calls == 1 and loop.self_us > 0 and loop.cumulative_us >= loop.self_us
    assert loop.name.startswith("tests/test_bench_profile.py:")  # relative to the checkout
    assert any(name.startswith("<built-in method builtins.sorted") for name in by_name)
    assert interpreted_us >= loop.self_us  # built-ins (sorted) are not the interpreter's own
    assert [f.self_us for f in top] == sorted((f.self_us for f in top), reverse=True)


def test_profiles_each_variant_on_one_engine(tiny_chat_model_dir, single_torch_thread, capsys):
    from engine import EngineConfig

    config = EngineConfig(model=str(tiny_chat_model_dir), decoder={"num_speculative_tokens": 2})
    results = run_profile_bench(
        config, ProfileOptions(decoders="autoregressive,ngram", steps=3, top=4, python_top=6)
    )
    assert [r.decoder for r in results] == ["autoregressive", "ngram"]
    plain, ngram = results
    assert plain.tokens_a_step == 1 and plain.draft_ms == 0
    assert 1 <= ngram.tokens_a_step <= 3  # at most k + 1 a step
    for r in results:
        assert r.ms_a_step > 0 and r.forward_ms > 0
        assert r.operator_calls > 0 and r.device_kernels == 0
        assert len(r.top) == 4 and all(op.calls > 0 for op in r.top)
        assert r.python_us > 0 and len(r.python_top) == 6
    out = capsys.readouterr().out
    assert "| autoregressive |" in out and "ngram: operators by self time" in out
    assert "ngram: Python functions by self time a step (cProfile)" in out


def test_refuses_unknown_variants_and_no_steps(tiny_chat_model_dir):
    from engine import EngineConfig

    config = EngineConfig(model=str(tiny_chat_model_dir))
    with pytest.raises(ValueError, match="unknown decoder variant"):
        run_profile_bench(config, ProfileOptions(decoders="autoregressive,no-such"))
    with pytest.raises(ValueError, match="at least 1"):
        run_profile_bench(config, ProfileOptions(steps=0))
    with pytest.raises(ValueError, match="--python must be at least 0"):
        run_profile_bench(config, ProfileOptions(python_top=-1))
