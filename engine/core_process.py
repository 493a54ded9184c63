"""The engine core in its own process, and the async client the server talks to it through.

Why a process: a forward pass holds the CPU (and much of the time the GIL); in the server's
process it would stall every other stream and the health checks. The child runs
``run_engine_core``: it loads the engine, then loops — drain commands, ``Engine.step()``, send
the step's deltas and a stats snapshot. The parent side, ``AsyncEngineClient``, never runs model
code and never blocks its event loop: two small threads own the pipe (see ``_EngineProcess``).

The child side lives in ``engine.core_loop``; it is imported only where a process is created,
so importing this module loads neither the engine nor torch.
The child is spawned, not forked: a fork would copy the server's threads, event loop and torch
thread pool mid-flight. As with any spawn, a script that starts a client must guard its entry
point with ``if __name__ == "__main__":``. Messages and errors live in ``engine.core_protocol``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.core_protocol import (
    AbortRequest,
    AddRequest,
    EngineDeadError,
    EngineInfo,
    EngineNotReadyError,
    EngineOutputs,
    EngineReady,
    EngineStartError,
    EngineStartFailed,
    EngineStats,
    RequestDelta,
    Shutdown,
    StreamBacklogError,
)

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams
    from engine.speculative_options import SpeculativeOptions

__all__ = [
    "AsyncEngineClient",
    "EngineDeadError",
    "EngineNotReadyError",
    "EngineStartError",
    "StreamBacklogError",
]

logger = logging.getLogger(__name__)


def _run_engine_core(config: EngineConfig, conn) -> None:
    """The engine process's entry: it, not the API process, imports the engine and torch."""
    from engine.core_loop import run_engine_core  # torch: in the child only

    run_engine_core(config, conn)


class _EngineProcess:
    """One spawned engine process and the two threads that own its pipe.

    The reader thread sleeps in ``conn.recv()`` and hands each message to the event loop with
    ``call_soon_threadsafe``. When the child dies, the kernel closes its end of the pipe and
    ``recv`` raises EOFError at once: the same thread then reaps the child and reports its exit
    code, after every message the child sent before dying (no race between "last outputs" and
    "dead", and no polling delay). We use a thread rather than ``loop.add_reader`` because a
    readable pipe may hold only part of a large message, and ``recv`` would then block the loop.
    The writer thread sends commands from a queue, because a big prompt can fill the pipe
    while the child is mid-step and not reading, and a send would block the loop just the same.
    Only the reader thread waits on the process, so two threads never race to reap it.
    """

    def __init__(
        self,
        config: EngineConfig,
        loop: asyncio.AbstractEventLoop,
        on_message: Callable[[_EngineProcess, object], None],
        on_exit: Callable[[_EngineProcess, int | None], None],
    ):
        ctx = multiprocessing.get_context("spawn")
        self._conn, self._child_conn = ctx.Pipe(duplex=True)
        # daemon: if the server exits without shutdown(), multiprocessing still ends the child.
        self.process = ctx.Process(
            target=_run_engine_core,
            args=(config, self._child_conn),
            name="specserve-engine",
            daemon=True,
        )
        self._loop, self._on_message, self._on_exit = loop, on_message, on_exit
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._writer = threading.Thread(target=self._write, name="engine-writer", daemon=True)
        self.ready: asyncio.Future[EngineInfo] = loop.create_future()
        self.start_error: str | None = None  # what the child said before exiting, if anything
        # Set on the event loop when the reader reports the exit; until then the process may
        # be dead already, but no event-loop code has been told.
        self.exited = False
        self.exit_code: int | None = None
        # start/stop/close may race (a shutdown while a cancelled start is unwinding): the lock
        # makes them take turns, and stop/close idempotent.
        self._lock = threading.Lock()
        self._started = self._released = False

    # ---- used from the event loop (non-blocking) ---------------------------------------
    def send(self, command: object) -> None:
        # Pickled now (cheap next to parsing the HTTP request), so the command is a snapshot:
        # later changes to the caller's params cannot reach the engine.
        self._commands.put(ForkingPickler.dumps(command))

    # ---- blocking: run these in a worker thread ----------------------------------------
    def start(self) -> None:
        with self._lock:
            if self._released:
                raise EngineStartError("the engine was stopped before it started")
            self.process.start()
            self._started = True
            # Drop our copy of the child's end, or its death would never read as EOF here.
            self._child_conn.close()
            self._reader.start()
            self._writer.start()

    def stop(self, timeout: float) -> None:
        """Ask the child to exit; terminate, then kill it if it does not; release all."""
        with self._lock:
            if self._started and not self._released:
                self.send(Shutdown())
                self._reader.join(timeout)
                if self._reader.is_alive():
                    self.process.terminate()
                    self._reader.join(2.0)
                if self._reader.is_alive():
                    self.process.kill()
                    self._reader.join()
            self._release()

    def close(self) -> None:
        """Release threads, pipe and process handle; the child must have exited."""
        with self._lock:
            self._release()

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        if self._started:
            self._reader.join()
            self._commands.put(None)
            self._writer.join()
            self.process.close()
        self._child_conn.close()
        self._conn.close()

    # ---- threads -----------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            self._post(self._on_message, self, message)
        # EOF: the child has exited or is exiting. One that closed the pipe but lingers
        # cannot serve anyway.
        self.process.join(1.0)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join()
        self._post(self._on_exit, self, self.process.exitcode)

    def _write(self) -> None:
        while (command := self._commands.get()) is not None:
            try:
                self._conn.send_bytes(command)
            except OSError:
                return  # the child is gone; the reader reports it

    def _post(self, callback: Callable, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            pass  # the loop is closed: nobody is listening any more


class AsyncEngineClient:
    """The server's handle on the engine process; use it from one asyncio event loop.

    ``await start()`` spawns the engine and waits until it is ready; ``generate`` streams a
    request's ``RequestDelta``s; ``abort`` and ``shutdown`` do what they say. If the engine process
    dies, every in-flight ``generate`` raises ``EngineDeadError`` and the client starts a new
    process, at most ``max_restarts`` times within any ``restart_window_s`` seconds (a sliding
    window, so an engine that crashes once a day is always restarted while a crash loop is
    not). ``ready`` is False while (re)starting and after giving up; ``last_error`` says why.
    ``stats`` is the current engine process's latest snapshot; ``totals`` carries its counters
    across restarts.

    The watchdog: with ``stall_timeout_s``, an engine process that is alive but has reported
    nothing for that long while requests are in flight (a hung kernel, a stopped process) is
    killed, which fails its streams and restarts it like any other death.

    Backpressure: each request's undelivered outputs are bounded by ``max_stream_backlog``. A
    consumer that falls that far behind (a client that stopped reading) gets
    ``StreamBacklogError`` after what is queued, and its request is aborted in the engine at
    once: it never slows the engine or other requests, and never holds memory or KV blocks.
    """

    def __init__(
        self,
        config: EngineConfig,
        max_restarts: int = 3,
        restart_window_s: float = 600.0,
        stall_timeout_s: float | None = None,
        max_stream_backlog: int = 1024,
        on_gave_up: Callable[[str], None] | None = None,
    ):
        self.config = config
        self.on_gave_up = on_gave_up  # called with last_error once restarting has stopped
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.stall_timeout_s = stall_timeout_s
        self.max_stream_backlog = max_stream_backlog
        self.ready = False
        self.info: EngineInfo | None = None
        self.stats = EngineStats()  # the latest snapshot from the engine
        self._counters_base = EngineStats()  # the counters of the engine processes that died
        self.last_error: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proc: _EngineProcess | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._restart_times: deque[float] = deque()
        self._restart_task: asyncio.Task | None = None
        self._closed = False
        # The watchdog's clock: the engine's last report, or when work arrived at an idle one.
        self._last_progress = time.monotonic()
        self._watchdog: asyncio.Task | None = None
        self._stall_reason: str | None = None

    @property
    def pid(self) -> int | None:
        """The engine process's pid (None before start and between restarts)."""
        return self._proc.process.pid if self._proc is not None else None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def totals(self) -> EngineStats:
        """``stats`` with its counters summed over every engine process this client has run
        (the gauges are the current process's)."""
        return dataclasses.replace(self.stats, **_sum_counters(self._counters_base, self.stats))

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> EngineInfo:
        """Spawn the engine process and wait until it has loaded the model.

        Raises ``EngineStartError`` (with the exit code and the child's error) if the process
        exits first, or before this coroutine has taken its ready report (a crash in its first
        step): such a start is not retried. Waiting happens off the event loop, which stays
        responsive.
        """
        if self._closed or self._proc is not None:
            raise RuntimeError("start() may be called once, before shutdown()")
        self._loop = asyncio.get_running_loop()
        info = await self._launch()
        if self.stall_timeout_s:
            self._watchdog = self._loop.create_task(self._watch(self.stall_timeout_s))
        return info

    async def wait_ready(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the engine to be ready; returns ``ready``.

        Returns early (False) once the client has given up restarting or was shut down.
        """
        deadline = time.monotonic() + timeout
        while not self.ready and time.monotonic() < deadline:
            if self._closed or (self._proc is None and self._restart_task is None):
                break
            await asyncio.sleep(0.05)
        return self.ready

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine gracefully (terminate, then kill, after ``timeout`` seconds) and
        release its threads, pipe and process; in-flight streams raise ``EngineDeadError``."""
        if self._closed:
            return
        # A child still loading cannot read the shutdown command: terminate it at once.
        grace = timeout if self.ready else 0.0
        self._closed, self.ready = True, False
        self.last_error = "the engine was shut down"
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
        if self._restart_task is not None:
            self._restart_task.cancel()
            await asyncio.gather(self._restart_task, return_exceptions=True)
        self._fail_streams("the engine was shut down")
        proc, self._proc = self._proc, None
        if proc is not None:
            await asyncio.to_thread(proc.stop, grace)

    # ---- requests ----------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        speculative: SpeculativeOptions | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Submit a request and yield its deltas; the last one has ``finished=True``.
        ``speculative`` picks one of ``info.decoders`` for this request.

        Raises ``EngineNotReadyError`` at once when the engine is not ready, ``ValueError``
        (the engine's message, before anything is yielded) when the engine refuses the
        request, and ``EngineDeadError`` if the engine process dies meanwhile. If the consumer
        stops early (break, ``aclose()``, cancellation) the request is aborted in the engine;
        wrap the iterator in ``contextlib.aclosing`` to make that happen at once on ``break``
        rather than when the generator is garbage-collected.
        """
        if not self.ready or self._proc is None or self._proc.exited:
            # An exited process would never answer, and its exit has already failed every
            # stream it had: a stream registered now would wait forever.
            raise EngineNotReadyError(self.last_error or "the engine is not ready")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        proc, stream = self._proc, asyncio.Queue()
        if not self._streams:  # an idle engine reports nothing: its clock starts now
            self._last_progress = time.monotonic()
        self._streams[request_id] = stream
        proc.send(AddRequest(request_id, list(prompt_token_ids), params, speculative))
        done = False  # nothing left in the engine to abort
        try:
            while not done:
                item = await stream.get()
                if isinstance(item, Exception):
                    done = True
                    raise item
                done = item.finished
                yield item
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not done and proc is self._proc:
                proc.send(AbortRequest(request_id))

    def end_streams(self, error: Exception) -> int:
        """End every open stream with ``error`` where its reader waits, and abort its request
        in the engine (the server's shutdown deadline); returns how many there were."""
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            stream.put_nowait(error)
            if self._proc is not None and not self._proc.exited:
                self._proc.send(AbortRequest(request_id))
        return len(streams)

    async def abort(self, request_id: str, choice_index: int | None = None) -> None:
        """Abort a request, or only its continuation ``choice_index``; the others go on.

        Each choice aborted this way then appears once more in the request's stream, in a
        ``ChoiceDelta`` with no new tokens and finish_reason "abort"; the stream ends when its
        last choice has finished. Deltas the engine produced before the command reached it
        still arrive first. A choice (or request) that had already finished is left alone.
        """
        if self._proc is not None and self.ready:
            self._proc.send(AbortRequest(request_id, choice_index))

    # ---- engine process management -----------------------------------------------------
    async def _launch(self) -> EngineInfo:
        self.ready = False
        proc = _EngineProcess(self.config, self._loop, self._on_message, self._on_exit)
        self._proc = proc
        # Spawning blocks for a moment, so it runs in a thread; a task, so that a cancelled
        # start still waits for it to finish before stopping a half-started process.
        spawning = asyncio.ensure_future(asyncio.to_thread(proc.start))
        try:
            await asyncio.shield(spawning)
            info = await proc.ready
            if proc.exited or proc is not self._proc:
                # It died between its ready report and now (e.g. in its first step): _on_exit
                # left it to us, as a failed start.
                raise EngineStartError(
                    f"the engine process exited (exit code {proc.exit_code}) right after it "
                    f"was ready: {proc.start_error or 'see its stderr'}"
                )
        except BaseException:
            if self._proc is proc:
                self._proc = None
            await asyncio.gather(spawning, return_exceptions=True)
            await asyncio.to_thread(proc.stop, 0.0)
            raise
        self.info, self.ready, self.last_error = info, True, None
        self._last_progress, self._stall_reason = time.monotonic(), None
        return info

    def _on_message(self, proc: _EngineProcess, message: object) -> None:
        if proc is not self._proc:
            return  # a late report from a process we have already replaced
        if isinstance(message, EngineOutputs):
            self._last_progress = time.monotonic()
            self.stats = message.stats
            for error in message.errors:
                self._deliver(error.request_id, ValueError(error.message))
            for delta in message.deltas:
                self._deliver(delta.request_id, delta)
        elif isinstance(message, EngineReady):
            if not proc.ready.done():
                proc.ready.set_result(message.info)
        elif isinstance(message, EngineStartFailed):
            proc.start_error = message.message

    def _deliver(self, request_id: str, item: RequestDelta | Exception) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return  # its consumer has gone: drop it
        if isinstance(item, RequestDelta) and stream.qsize() >= self.max_stream_backlog:
            del self._streams[request_id]
            stream.put_nowait(
                StreamBacklogError(
                    f"request {request_id} was aborted: its client fell "
                    f"{self.max_stream_backlog} outputs behind (it stopped reading?)"
                )
            )
            if self._proc is not None and not self._proc.exited:
                self._proc.send(AbortRequest(request_id))
            return
        stream.put_nowait(item)

    def _on_exit(self, proc: _EngineProcess, exitcode: int | None) -> None:
        proc.exited, proc.exit_code = True, exitcode
        if not proc.ready.done():
            detail = proc.start_error or "see its stderr"
            message = f"the engine process exited (exit code {exitcode}) before it was ready"
            proc.ready.set_exception(EngineStartError(f"{message}: {detail}"))
        if proc is not self._proc or self._closed:
            return  # an expected exit (shutdown) or one already handled
        # Its queues and cache are gone; its counters live on in the totals.
        self._counters_base = EngineStats(**_sum_counters(self._counters_base, self.stats))
        self.stats = EngineStats()
        if not self.ready:
            return  # _launch has not taken it into service yet: it raises EngineStartError
        self.ready = False
        self.last_error = self._stall_reason or f"the engine process died (exit code {exitcode})"
        logger.error("%s; %d requests in flight", self.last_error, len(self._streams))
        self._fail_streams(self.last_error)
        # A restart task ends in the same step as the _launch that takes its process into
        # service, so none runs here; never start a second that shutdown() could not cancel.
        if self._restart_task is None:
            self._restart_task = self._loop.create_task(self._restart(proc))

    async def _watch(self, timeout: float) -> None:
        """Kill an engine that stopped making progress with work in flight (see the class)."""
        while not self._closed:
            await asyncio.sleep(min(1.0, timeout / 4))
            proc = self._proc
            if not (self.ready and self._streams and proc is not None and not proc.exited):
                continue
            silent = time.monotonic() - self._last_progress
            if silent > timeout:
                self._stall_reason = (
                    f"the engine process made no progress for {silent:.0f} s with "
                    f"{len(self._streams)} requests in flight; it was killed"
                )
                logger.error(self._stall_reason)
                proc.process.kill()  # its exit fails the streams and restarts it (_on_exit)

    def _fail_streams(self, message: str) -> None:
        for stream in self._streams.values():
            stream.put_nowait(EngineDeadError(message))
        self._streams.clear()  # their ids may be reused at once

    async def _restart(self, dead: _EngineProcess) -> None:
        try:
            if self._proc is dead:
                self._proc = None
            await asyncio.to_thread(dead.close)
            while not self._closed:
                if not self._may_restart():
                    self.last_error += (
                        f"; gave up after {self.max_restarts} restarts "
                        f"within {self.restart_window_s:g} s"
                    )
                    logger.error(self.last_error)
                    if self.on_gave_up is not None:
                        self.on_gave_up(self.last_error)
                    return
                self._restart_times.append(time.monotonic())
                try:
                    await self._launch()
                    logger.info("engine process restarted (pid %s)", self.pid)
                    return
                except Exception as e:  # EngineStartError, or a failure to spawn at all
                    self.last_error = str(e)
                    logger.error("engine restart failed: %s", e)
        finally:
            if self._restart_task is asyncio.current_task():
                self._restart_task = None

    def _may_restart(self) -> bool:
        cutoff = time.monotonic() - self.restart_window_s
        while self._restart_times and self._restart_times[0] < cutoff:
            self._restart_times.popleft()
        return len(self._restart_times) < self.max_restarts


def _sum_counters(a: EngineStats, b: EngineStats) -> dict:
    per_decoder = ("spec_by_decoder", "spec_draft_lengths")
    summed = {
        name: _add(getattr(a, name), getattr(b, name))
        for name in EngineStats.COUNTERS
        if name not in per_decoder
    }
    for name in per_decoder:  # (decoder, counts) pairs: add the counts decoder by decoder
        merged = dict(getattr(a, name))
        for decoder, counts in getattr(b, name):
            old = merged.get(decoder)
            merged[decoder] = counts if old is None else _add(old, counts)
        summed[name] = tuple(merged.items())
    return summed


def _add(a, b):
    if isinstance(a, tuple):  # per-position counts (or nested ones): add item by item
        longest = max(len(a), len(b))
        a, b = a + (0,) * (longest - len(a)), b + (0,) * (longest - len(b))
        return tuple(_add(x, y) for x, y in zip(a, b, strict=True))
    return a + b
