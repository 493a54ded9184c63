"""Fault injection for AsyncEngineClient: engine processes that die right after reporting
ready (a crash on the first step). A fake process object stands in for the child so that the
ready report and the death can arrive in one go, the race a real child makes rare."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from engine import EngineConfig, SamplingParams
from engine.core_process import (
    AsyncEngineClient,
    EngineDeadError,
    EngineNotReadyError,
    EngineStartError,
)
from engine.core_protocol import EngineInfo, EngineReady
from tests.test_core_process import collect, wait_until


class FakeEngineProcess:
    """Stands in for ``_EngineProcess``, without a child.

    ``start`` (in a worker thread, like the real one) acts out the next entry of ``plan``:
    "healthy" reports ready; "crashes-after-ready" reports ready and then its exit in one
    event-loop callback, the worst order the reader thread can produce: the exit is handled
    before the task awaiting the ready report resumes; "manual" does nothing, and the test
    calls ``report_ready``, ``crash_after_ready`` or ``die`` itself, on the event loop.
    """

    INFO = EngineInfo(model_dir="/fake", max_model_len=64, vocab_size=320, eos_token_ids=[2])

    def __init__(self, plan, launched, config, loop, on_message, on_exit):
        self.plan, self.loop = plan, loop
        self.on_message, self.on_exit = on_message, on_exit
        self.process = SimpleNamespace(pid=100_000 + len(launched))
        self.ready = loop.create_future()
        self.start_error, self.exited, self.exit_code = None, False, None
        self.started = self.released = False
        launched.append(self)

    def start(self) -> None:
        self.started = True
        behaviour = self.plan.pop(0) if self.plan else "crashes-after-ready"
        if behaviour == "healthy":
            self.loop.call_soon_threadsafe(self.report_ready)
        elif behaviour == "crashes-after-ready":
            self.loop.call_soon_threadsafe(self.crash_after_ready)

    def report_ready(self) -> None:
        self.on_message(self, EngineReady(self.INFO))

    def crash_after_ready(self) -> None:
        self.report_ready()
        self.die(1)

    def die(self, exitcode: int) -> None:
        self.on_exit(self, exitcode)

    def send(self, command) -> None:
        pass

    def stop(self, timeout: float) -> None:
        self.released = True

    def close(self) -> None:
        self.released = True


def fake_processes(monkeypatch, plan: list[str]) -> list[FakeEngineProcess]:
    """Make clients start FakeEngineProcesses; returns the list of those launched."""
    launched: list[FakeEngineProcess] = []
    monkeypatch.setattr(
        "engine.core_process._EngineProcess",
        lambda *args: FakeEngineProcess(plan, launched, *args),
    )
    return launched


def no_other_tasks() -> bool:
    return asyncio.all_tasks() == {asyncio.current_task()}


def test_engine_dying_right_after_ready_fails_the_start(monkeypatch):
    launched = fake_processes(monkeypatch, ["crashes-after-ready"])
    client = AsyncEngineClient(EngineConfig(), max_restarts=3)

    async def scenario():
        with pytest.raises(EngineStartError, match="exit code 1.*right after it was ready"):
            await client.start()
        assert not client.ready and client.pid is None
        assert not await client.wait_ready(1)  # a failed start is not retried
        with pytest.raises(EngineNotReadyError):
            await collect(client, "x", [1], SamplingParams())
        await client.shutdown()
        assert no_other_tasks()

    asyncio.run(scenario())
    assert len(launched) == 1 and launched[0].released


def test_restarts_dying_right_after_ready_are_bounded_and_leave_nothing(monkeypatch):
    launched = fake_processes(monkeypatch, ["healthy"])  # then every restart crashes
    client = AsyncEngineClient(EngineConfig(), max_restarts=2)

    async def scenario():
        await client.start()
        stream = client.generate("doomed", [1, 2], SamplingParams())
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # the request is in flight
        launched[0].die(-9)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(first, 2)
        assert not await client.wait_ready(5)
        assert "gave up after 2 restarts" in client.last_error
        assert client._restart_task is None and client.pid is None
        with pytest.raises(EngineNotReadyError):
            await asyncio.wait_for(collect(client, "x", [1], SamplingParams()), 2)
        await client.shutdown()
        assert no_other_tasks()

    asyncio.run(scenario())
    assert len(launched) == 3 and all(p.released for p in launched)


def test_request_sent_as_a_restarted_engine_dies_fails_fast(monkeypatch):
    launched = fake_processes(monkeypatch, ["healthy", "manual", "healthy"])
    client = AsyncEngineClient(EngineConfig())

    async def scenario():
        await client.start()
        launched[0].die(-9)
        await wait_until(lambda: len(launched) == 2 and launched[1].started)
        await asyncio.sleep(0.2)  # the restart is now awaiting the new process's ready report
        second = launched[1]

        async def request_as_soon_as_ready():
            await second.ready  # resumes right after the restart does
            return await collect(client, "early", [1, 2], SamplingParams())

        attempt = asyncio.ensure_future(request_as_soon_as_ready())
        await asyncio.sleep(0)  # it awaits the ready report too
        second.crash_after_ready()
        with pytest.raises(EngineNotReadyError):
            await asyncio.wait_for(attempt, 2)  # rather than waiting forever
        assert await client.wait_ready(5) and client.pid == launched[2].process.pid
        await client.shutdown()
        assert no_other_tasks()

    asyncio.run(scenario())
    assert len(launched) == 3 and all(p.released for p in launched)
