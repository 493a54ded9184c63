"""A bounded shutdown: on SIGTERM or SIGINT the server stops accepting requests, lets what is
running finish for up to ``--shutdown-timeout`` seconds, then ends the streams still open
with an error event and ``[DONE]`` (and the other requests still running with a 503), stops
the engine and exits with status 0. When the engine cannot be (re)started, the server exits
the same way with status 1 (``Shutdown.fail``).

Uvicorn alone waits for open connections without a bound (a client that keeps a stream open
keeps the server alive, its engine generating), and sse-starlette's own drain ends streams
without a word; so the server runs its own uvicorn ``Server`` that starts this clock, and at
the deadline every engine stream still open fails with ``ShutdownDeadline`` where its reader
waits (no extra task races a response's generators), which the response turns into an error
event and [DONE], or a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading

import uvicorn

log = logging.getLogger("specserve.shutdown")

SHUTDOWN_MESSAGE = "the server is shutting down"


class Shutdown:
    """The shutdown clock one app shares: ``stopping`` once a signal came; ``timeout_s``
    later, ``at_deadline`` runs (the server ends every engine stream still open with
    ``ShutdownDeadline``, which each response turns into its ending)."""

    def __init__(self, timeout_s: float = 30.0, at_deadline=lambda: None):
        self.timeout_s = timeout_s
        self.stopping = False
        self.at_deadline = at_deadline
        # Why the server must exit (the engine never started, or it gave up restarting it),
        # and how: the running ``Server`` sets ``exit_server``; the process then exits 1.
        self.fatal: str | None = None
        self.exit_server = lambda: None

    def fail(self, reason: str) -> None:
        """The server cannot serve again: say why, and exit instead of answering 503 forever
        (a supervisor, Kubernetes or Ray Serve, then restarts or replaces it)."""
        if self.fatal is not None:
            return
        self.fatal = reason
        log.error("%s; the server exits", reason)
        self.exit_server()

    def begin(self) -> None:
        """Start the clock (on the event loop's thread)."""
        if self.stopping:
            return
        self.stopping = True
        log.info("shutting down: open requests have %.3g s to finish", self.timeout_s)
        asyncio.get_running_loop().call_later(self.timeout_s, self.at_deadline)


class ShutdownDeadline(Exception):
    """The shutdown deadline passed while a request was still running."""


class Server(uvicorn.Server):
    """Uvicorn's server with the shutdown clock: a signal starts it in the app (and uvicorn's
    own drain, bounded a little past it), and the process exits 0 after a clean shutdown
    instead of re-raising the signal."""

    def __init__(self, config: uvicorn.Config, shutdown: Shutdown):
        super().__init__(config)
        self.clock = shutdown  # (``shutdown`` is uvicorn's own method)
        self.loop: asyncio.AbstractEventLoop | None = None
        shutdown.exit_server = self._exit_on_failure

    def _exit_on_failure(self) -> None:
        """(On the event loop's thread.) Stop as after a signal: requests still running get
        the shutdown clock."""
        self.should_exit = True
        self.clock.begin()

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        super().handle_exit(sig, frame)
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.clock.begin)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
