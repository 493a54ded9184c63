"""The engine in its own process, driven through AsyncEngineClient.

One client (one engine process on the tiny model) is shared by most tests: it runs on an event
loop in a background thread, and each test submits a coroutine to it. Spawning an engine costs
a few seconds of imports, so only the start-failure and shutdown tests start their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Pipe
from pathlib import Path

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.core_loop import run_engine_core
from engine.core_process import (
    AsyncEngineClient,
    EngineDeadError,
    EngineNotReadyError,
    EngineStartError,
)
from engine.core_protocol import AddRequest, EngineReady, EngineStats, RequestDelta

MAX_MODEL_LEN = 512
LONG = SamplingParams(max_tokens=400, ignore_eos=True)  # hundreds of steps: time to interrupt


def tiny_config(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir)).with_overrides(
        kv_cache={"num_blocks": 64},
        scheduler={"max_model_len": MAX_MODEL_LEN},
        num_threads=1,  # the machine is shared; one core is plenty for the tiny model
    )


class LoopThread:
    """An event loop running in a daemon thread; ``run`` waits for a coroutine on it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """(loop thread, started client) shared by the module."""
    runner = LoopThread()
    client = AsyncEngineClient(tiny_config(tiny_model_dir))
    try:
        info = runner.run(client.start())
        assert info.vocab_size == 320 and info.max_model_len == MAX_MODEL_LEN
        assert info.eos_token_ids == [2]
        yield runner, client
    finally:
        runner.run(client.shutdown())
        runner.close()


async def collect(client, request_id, prompt, params) -> list[RequestDelta]:
    return [d async for d in client.generate(request_id, prompt, params)]


async def wait_until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def all_blocks_free(client) -> bool:
    s = client.stats
    return (
        s.num_blocks > 0
        and s.num_free_blocks == s.num_blocks
        and s.num_running == 0 == s.num_waiting
    )


def joined(deltas: list[RequestDelta], index: int):
    """(token ids, logprobs or None, finish reasons) of one choice across deltas."""
    choices = [c for d in deltas for c in d.choices if c.index == index]
    tokens = [t for c in choices for t in c.new_token_ids]
    logprobs = None
    if choices[0].new_logprobs is not None:
        logprobs = [lp for c in choices for lp in c.new_logprobs]
    return tokens, logprobs, [c.finish_reason for c in choices if c.finish_reason]


# ---- generation ----------------------------------------------------------------------------
def test_concurrent_requests_match_offline_llm(served, tiny_model_dir):
    runner, client = served
    prompts = [[5, 17, 99, 3], [250, 251], [7] * 40, [1, 2, 3, 4, 5, 6], [300, 12, 64], [8, 9]]
    params = [
        SamplingParams(temperature=0, max_tokens=8),
        SamplingParams(temperature=0, max_tokens=24, logprobs=3),
        SamplingParams(temperature=0, max_tokens=16, n=2),
        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1),
        # Seeded sampling draws from the request's own generator: the batch cannot change it.
        SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=12),
    ]

    async def run_all():
        jobs = [
            collect(client, f"g{i}", p, sp)
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        return await asyncio.gather(*jobs)

    started = time.time()
    results = runner.run(run_all())
    offline = LLM(config=tiny_config(tiny_model_dir).with_overrides(num_threads=None))
    expected = offline.generate(prompts, params)
    for deltas, want, prompt in zip(results, expected, prompts, strict=True):
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
        assert all(d.num_prompt_tokens == len(prompt) for d in deltas)
        assert started <= deltas[0].first_scheduled_time <= time.time()
        for completion in want.outputs:
            tokens, logprobs, reasons = joined(deltas, completion.index)
            assert tokens == completion.token_ids
            assert reasons == [completion.finish_reason]  # sent exactly once
            if completion.logprobs is None:
                assert logprobs is None
            else:
                assert [lp.token_id for lp in logprobs] == completion.token_ids
                for got, ref in zip(logprobs, completion.logprobs, strict=True):
                    assert got.logprob == pytest.approx(ref.logprob, abs=1e-4)
                    assert [t for t, _ in got.top_logprobs] == [t for t, _ in ref.top_logprobs]
    assert client.num_in_flight == 0
    stats = client.stats  # sent with the last deltas
    assert all_blocks_free(client) and stats.kv_cache_usage == 0
    assert stats.prefix_cache_queries >= sum(map(len, prompts))


@pytest.mark.parametrize(
    "prompt,params,message",
    [
        ([5] * 600, SamplingParams(), f"context length is {MAX_MODEL_LEN}"),
        ([5, 100000], SamplingParams(), "prompt token ids must be in [0, 320)"),
        ([5] * 500, SamplingParams(max_tokens=20), "plus max_tokens (20)"),
    ],
    ids=["longer-than-context", "token-out-of-vocab", "prompt-plus-max-tokens"],
)
def test_refused_request_raises_engine_message_and_engine_keeps_serving(
    served, prompt, params, message
):
    runner, client = served
    with pytest.raises(ValueError) as excinfo:
        runner.run(collect(client, "bad", prompt, params))
    assert message in str(excinfo.value)
    deltas = runner.run(collect(client, "good", [4, 5, 6], SamplingParams(max_tokens=3)))
    assert deltas[-1].finished
    assert client.num_in_flight == 0


def test_duplicate_request_id_is_refused(served):
    runner, client = served

    async def scenario():
        first = client.generate("dup", [4, 5], LONG)
        await first.__anext__()
        with pytest.raises(ValueError, match="already in flight"):
            await collect(client, "dup", [4, 5], SamplingParams())
        await first.aclose()
        await wait_until(lambda: all_blocks_free(client))

    runner.run(scenario())


# ---- leaving early: the request is aborted and its blocks freed ----------------------------
def record_deliveries(client, monkeypatch) -> list:
    """Spy on what the client receives, including deltas for streams that have gone."""
    seen = []
    deliver = client._deliver

    def spy(request_id, item):
        seen.append(item)
        deliver(request_id, item)

    monkeypatch.setattr(client, "_deliver", spy)
    return seen


async def leave_by_break(client, request_id):
    async for _ in client.generate(request_id, [9, 8, 7], LONG):
        break  # the dropped generator is closed by the loop's async-generator finalizer


async def leave_by_aclose(client, request_id):
    async with contextlib.aclosing(client.generate(request_id, [9, 8, 7], LONG)) as stream:
        async for _ in stream:
            break


async def leave_by_cancel(client, request_id):
    got_one = asyncio.Event()

    async def consume():
        async for _ in client.generate(request_id, [9, 8, 7], LONG):
            got_one.set()

    task = asyncio.create_task(consume())  # like a handler whose client disconnected
    await got_one.wait()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("leave", [leave_by_break, leave_by_aclose, leave_by_cancel])
def test_consumer_leaving_early_aborts_request_and_frees_blocks(served, monkeypatch, leave):
    runner, client = served
    seen = record_deliveries(client, monkeypatch)

    async def scenario():
        await leave(client, "leaver")
        await wait_until(lambda: all_blocks_free(client))

    runner.run(scenario())
    last = [d for d in seen if isinstance(d, RequestDelta)][-1]
    assert last.finished and last.choices[0].finish_reason == "abort"
    assert client.num_in_flight == 0


def test_abort_ends_stream_with_abort_reason(served):
    runner, client = served

    async def scenario():
        deltas = []
        async for delta in client.generate("cancelled", [3, 4], LONG):
            if not deltas:
                await client.abort("cancelled")
            deltas.append(delta)
        return deltas

    deltas = runner.run(scenario())
    assert deltas[-1].finished and deltas[-1].choices[0].finish_reason == "abort"
    assert len(deltas) < 100
    runner.run(wait_until(lambda: all_blocks_free(client)))


def test_aborting_one_choice_ends_it_and_the_others_go_on(served):
    runner, client = served
    params = SamplingParams(n=3, temperature=1.0, seed=21, max_tokens=300, ignore_eos=True)

    async def scenario():
        reference = await collect(client, "whole", [40, 41, 42], params)
        deltas = []
        async for delta in client.generate("partial", [40, 41, 42], params):
            if not deltas:
                await client.abort("partial", choice_index=1)
            deltas.append(delta)
        await wait_until(lambda: all_blocks_free(client))
        return reference, deltas

    reference, deltas = runner.run(scenario())
    assert deltas[-1].finished
    tokens, _, reasons = joined(deltas, 1)
    assert reasons == ["abort"] and len(tokens) < 300
    assert tokens == joined(reference, 1)[0][: len(tokens)]
    # The abort is the choice's last entry, and brings no tokens.
    last = [c for d in deltas for c in d.choices if c.index == 1][-1]
    assert (last.new_token_ids, last.finish_reason) == ([], "abort")
    for index in (0, 2):  # seeded per choice: token-identical to the run without the abort
        assert joined(deltas, index) == joined(reference, index)
        assert joined(deltas, index)[2] == ["length"]


def test_aborting_every_choice_ends_the_stream(served):
    runner, client = served
    params = SamplingParams(n=2, max_tokens=400, ignore_eos=True)

    async def scenario():
        deltas = []
        async for delta in client.generate("all-choices", [3, 4], params):
            if not deltas:
                await client.abort("all-choices", choice_index=0)
                await client.abort("all-choices", choice_index=1)
            deltas.append(delta)
        await wait_until(lambda: all_blocks_free(client))
        return deltas

    deltas = runner.run(scenario())
    assert deltas[-1].finished and len(deltas) < 100
    assert joined(deltas, 0)[2] == joined(deltas, 1)[2] == ["abort"]
    assert client.num_in_flight == 0


# ---- the engine process dies ---------------------------------------------------------------
def test_killed_engine_fails_in_flight_stream_then_restarts(served):
    runner, client = served

    async def scenario():
        old_pid = client.pid
        stream = client.generate("doomed", [11, 12, 13], LONG)
        await stream.__anext__()
        killed_at = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exit code -9"):
            async for _ in stream:
                pass
        assert time.monotonic() - killed_at < 2.0
        assert not client.ready and client.num_in_flight == 0
        with pytest.raises(EngineNotReadyError):
            await collect(client, "too-early", [1, 2], SamplingParams())
        assert await client.wait_ready(60)
        assert client.pid not in (None, old_pid)
        # ignore_eos: an unseeded sample of EOS would end it early (a 1-in-80 flake)
        after = SamplingParams(max_tokens=4, ignore_eos=True)
        return await collect(client, "after", [11, 12, 13], after)

    deltas = runner.run(scenario(), timeout=90)
    assert sum(len(c.new_token_ids) for d in deltas for c in d.choices) == 4
    assert deltas[-1].finished


def test_totals_carry_engine_counters_across_a_restart(served):
    runner, client = served
    # Three sequences of 437 tokens need 84 blocks of 16 and the cache has 64: preemptions.
    # Their prompts share a full block with a request that ran before them: prefix hits.
    shared, crowd = [5] * 16, SamplingParams(max_tokens=420, ignore_eos=True)

    async def run_crowd(tag):
        await collect(client, f"{tag}-first", [*shared, 1], SamplingParams(max_tokens=1))
        await asyncio.gather(
            *(collect(client, f"{tag}{i}", [*shared, 20 + i], crowd) for i in range(3))
        )
        return client.stats

    async def scenario():
        before_kill = await run_crowd("before")
        totals_before = client.totals
        os.kill(client.pid, signal.SIGKILL)
        await wait_until(lambda: not client.ready)
        assert client.stats == EngineStats()  # the raw snapshot died with the process
        totals_dead = client.totals
        assert await client.wait_ready(60)
        after_restart = await run_crowd("after")
        return before_kill, totals_before, totals_dead, after_restart, client.totals

    before_kill, totals_before, totals_dead, after, totals = runner.run(scenario(), timeout=120)
    assert before_kill.num_preemptions > 0 and after.num_preemptions > 0
    assert client.stats == after  # stats stays the latest raw snapshot
    # The counters this autoregressive engine moves (the spec_* ones stay at zero here).
    for name in ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits"):
        assert getattr(totals_dead, name) == getattr(totals_before, name)
        assert getattr(totals_before, name) >= getattr(before_kill, name) > 0
        assert getattr(totals, name) == getattr(totals_before, name) + getattr(after, name)
    # The gauges are the running engine's.
    assert (totals.num_blocks, totals.num_free_blocks) == (after.num_blocks, after.num_free_blocks)
    assert totals.num_running == after.num_running == 0


def test_exception_in_step_logs_traceback_and_exits_nonzero(monkeypatch, capsys):
    class Arch:
        vocab_size = 320

    class Model:
        arch = Arch()

    class FailingEngine:
        max_model_len, model, eos_token_ids = 64, Model(), {2}
        loaded_decoders = ["autoregressive"]

        def calibrate_step_costs(self):
            pass

        def add_request(self, *args):
            pass

        def has_unfinished_requests(self):
            return True

        def step(self):
            raise RuntimeError("boom in step")

    monkeypatch.setattr(
        "engine.core_loop.create_engine", lambda config, companions=(): (FailingEngine(), "/m")
    )
    server_end, engine_end = Pipe()
    server_end.send(AddRequest("r", [1], SamplingParams()))
    with pytest.raises(SystemExit) as excinfo:
        run_engine_core(EngineConfig(), engine_end)
    assert excinfo.value.code == 1
    assert server_end.poll(5), "the engine never reported ready"
    assert isinstance(server_end.recv(), EngineReady)
    assert "RuntimeError: boom in step" in capsys.readouterr().err


# ---- starting and stopping -----------------------------------------------------------------
def test_engine_that_fails_to_start_raises_with_exit_code(tmp_path):
    client = AsyncEngineClient(EngineConfig(model=str(tmp_path)))  # no config.json there

    async def scenario():
        with pytest.raises(EngineStartError) as excinfo:
            await client.start()
        assert "exit code 1" in str(excinfo.value) and "has no config.json" in str(excinfo.value)
        assert not client.ready and client.pid is None
        with pytest.raises(EngineNotReadyError):
            await collect(client, "x", [1], SamplingParams())

    asyncio.run(scenario())


@pytest.mark.parametrize("delay", [0.0, 0.5], ids=["while-spawning", "while-loading"])
def test_shutdown_during_start_leaves_no_process(tiny_model_dir, served, delay):
    fds, children = open_fds(), multiprocessing.active_children()
    client = AsyncEngineClient(tiny_config(tiny_model_dir))

    async def scenario():
        starting = asyncio.create_task(client.start())
        await asyncio.sleep(delay)
        starting.cancel()  # what a server does when it is stopped during startup
        await client.shutdown()
        (result,) = await asyncio.gather(starting, return_exceptions=True)
        assert isinstance(result, asyncio.CancelledError | EngineStartError)

    asyncio.run(scenario())
    assert multiprocessing.active_children() == children
    assert open_fds() == fds and not client.ready


def open_fds() -> int:
    # Collect first: garbage of earlier tests (a file, a pipe) closed mid-test would otherwise
    # lower the count and pass for a difference this test did not make.
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


def test_shutdown_stops_the_process_and_releases_everything(tiny_model_dir, served):
    # `served` first, so its engine is already running and its fds are in the baseline.
    fds, threads = open_fds(), threading.active_count()
    client = AsyncEngineClient(tiny_config(tiny_model_dir))

    async def scenario():
        await client.start()
        pid = client.pid
        deltas = await collect(client, "one", [5, 6], SamplingParams(max_tokens=2))
        assert deltas[-1].finished
        stream = client.generate("in-flight", [5, 6], LONG)
        await stream.__anext__()
        await client.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass
        return pid

    pid = asyncio.run(scenario())
    assert pid not in [p.pid for p in multiprocessing.active_children()]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped: no zombie left behind
    assert not client.ready and client.pid is None
    assert open_fds() == fds and threading.active_count() == threads


def test_client_gives_up_after_max_restarts(tiny_model_dir):
    client = AsyncEngineClient(tiny_config(tiny_model_dir), max_restarts=0)

    async def scenario():
        await client.start()
        pid = client.pid
        stream = client.generate("doomed", [5, 6], LONG)
        await stream.__anext__()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        assert not await client.wait_ready(5)  # returns early: nothing is restarting
        assert "gave up after 0 restarts" in client.last_error
        with pytest.raises(EngineNotReadyError, match="gave up"):
            await collect(client, "x", [1], SamplingParams())
        await client.shutdown()
        return pid

    started = time.monotonic()
    pid = asyncio.run(scenario())
    assert time.monotonic() - started < 30
    assert pid not in [p.pid for p in multiprocessing.active_children()]


def test_importing_the_client_loads_neither_the_engine_nor_torch():
    code = (
        "import sys, engine.core_process; "
        "print([m for m in ('torch', 'engine.engine') if m in sys.modules])"
    )
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
