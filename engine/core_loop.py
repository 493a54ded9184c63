"""The engine process's side: load the engine, then loop over commands and steps.

``run_engine_core`` is the spawn target of ``engine.core_process.AsyncEngineClient``; messages
are defined in ``engine.core_protocol``.
"""

from __future__ import annotations

import multiprocessing
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection

from engine.config import EngineConfig
from engine.core_protocol import (
    AbortRequest,
    AddRequest,
    DeltaTracker,
    EngineOutputs,
    EngineReady,
    EngineStartFailed,
    RequestError,
    Shutdown,
    engine_info,
    engine_stats,
)
from engine.engine import Engine, create_engine


def run_engine_core(config: EngineConfig, conn: Connection) -> None:
    """Entry point of the engine process (the spawn target): load, report ready, serve.

    Sends ``EngineReady`` (or ``EngineStartFailed``) first, then one ``EngineOutputs`` per loop
    iteration. Returns when told to shut down or when the server's end of the pipe closes; a
    failure while loading or stepping prints the traceback to stderr and exits with code 1.
    """
    if multiprocessing.parent_process() is not None:
        # Ctrl-C in a terminal reaches the whole process group; the server decides when we stop.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        parent = multiprocessing.parent_process()
        engine, model_dir = create_engine(config, (parent.pid,) if parent else ())
        engine.calibrate_step_costs()
    except Exception as e:
        traceback.print_exc()
        _send_quietly(conn, EngineStartFailed(f"{type(e).__name__}: {e}"))
        sys.exit(1)
    try:
        conn.send(EngineReady(engine_info(engine, model_dir)))
        _CoreLoop(engine, conn).run()
    except (EOFError, ConnectionError):
        pass  # the server is gone: there is nobody left to serve
    except Exception:
        traceback.print_exc()
        sys.exit(1)


def _send_quietly(conn: Connection, message: object) -> None:
    try:
        conn.send(message)
    except (OSError, EOFError):
        pass  # best effort: the exit code tells the server the rest


class _CoreLoop:
    """The child's loop: commands in, one engine step, deltas and stats out."""

    def __init__(self, engine: Engine, conn: Connection):
        self.engine = engine
        self.conn = conn
        self.deltas = DeltaTracker()

    def run(self) -> None:
        while True:
            # Idle: sleep in recv until a command comes. Busy: only take what is already there.
            commands = self._receive(block=not self.engine.has_unfinished_requests())
            out = EngineOutputs()
            for command in commands:
                if isinstance(command, Shutdown):
                    return
                self._apply(command, out)
            if self.engine.has_unfinished_requests():
                self._step(out)
            out.stats = engine_stats(self.engine)
            self.conn.send(out)

    def _receive(self, block: bool) -> list:
        commands = [self.conn.recv()] if block else []
        while self.conn.poll(0):
            commands.append(self.conn.recv())
        return commands

    def _apply(self, command: AddRequest | AbortRequest, out: EngineOutputs) -> None:
        if isinstance(command, AddRequest):
            try:
                self.engine.add_request(
                    command.request_id,
                    command.prompt_token_ids,
                    command.params,
                    command.speculative,
                )
            except ValueError as e:  # the request never starts; the engine carries on
                out.errors.append(RequestError(command.request_id, str(e)))
        elif command.choice_index is not None:
            # Frees the sequence's blocks now; this iteration's step reports the "abort".
            self.engine.abort_sequence(command.request_id, command.choice_index)
        else:
            # Engine.abort frees the request's blocks now, before the next step.
            final = self.engine.abort(command.request_id)
            if final is not None:
                out.deltas.append(self.deltas.delta(final))

    def _step(self, out: EngineOutputs) -> None:
        started = time.time()
        outputs = self.engine.step()
        # Requests in the running queue after the step were scheduled by it (or earlier); this
        # catches a prompt whose first prefill chunk has produced no output yet. A request
        # that finished within its first step is caught by delta(scheduled_at=...).
        self.deltas.mark_scheduled((s.request_id for s in self.engine.scheduler.running), started)
        out.deltas.extend(self.deltas.delta(o, scheduled_at=started) for o in outputs)
