"""``python -m server.ray_serve.tethered PARENT_PID NAME ARGS...``: run ``specserve ARGS...``
for as long as process PARENT_PID lives (NAME, the replica's, only labels the process).

A replica's server must not outlive its replica: Ray kills a failed or scaled-down replica's
actor outright (no destructor runs), and a server left behind would hold its port, its engine
process and its memory. The tether polls its parent and, once it is gone, stops the server as a
signal would (open streams get their error event, the engine process exits), killing it if
it has not gone within its shutdown time.

The tether also passes the server's stderr on to its own, line by line, and when the server
fails writes the server's own error line to the file ``SPECSERVE_TETHER_REASON_FILE`` names:
the replica reports it (an operator reads the replica's error, not the worker log the line
would otherwise be buried in). The tether reads the pipe, not the replica, so a server whose
replica was killed outright still writes its shutdown lines somewhere.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque

# Where the tether writes why its server failed (its `error:` line), for the replica to report.
REASON_FILE_ENV = "SPECSERVE_TETHER_REASON_FILE"
POLL_S = 0.5
GRACE_S = 40.0  # the server's own shutdown timeout (30 s) and some
PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)


def _die_with_the_tether() -> None:
    """In the server, before it runs: SIGTERM it when the tether dies, however it dies (a
    tether killed outright cannot stop it; its server was seen left behind, orphaned)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the tether's own watch remains
        pass


class StderrRelay:
    """The server's stderr, passed on line by line to the tether's own (a replica's: Ray's
    worker log, a file, which takes writes whether or not the replica still lives), the
    last lines kept to say why a server failed."""

    def __init__(self, stream, keep: int = 40):
        self.lines: deque[str] = deque(maxlen=keep)
        self._thread = threading.Thread(target=self._relay, args=(stream,), daemon=True)
        self._thread.start()

    def _relay(self, stream) -> None:
        for line in iter(stream.readline, ""):
            try:
                sys.stderr.write(line)
                sys.stderr.flush()
            except OSError:  # our own stderr gone: keep reading, or the server would block
                pass
            self.lines.append(line.rstrip("\n"))

    def reason(self, timeout: float = 5.0) -> str:
        """The server's own ``error: ...`` line (the CLI's way of failing), else its last
        line; call once it has exited (waits for its last lines)."""
        self._thread.join(timeout)
        lines = [line for line in self.lines if line.strip()]
        errors = [line for line in lines if re.match(r"(specserve \w+: )?error:", line)]
        return (errors or lines or ["(no output)"])[-1]


def main(argv: list[str]) -> int:
    parent, args = int(argv[0]), argv[2:]
    child = subprocess.Popen(
        [sys.executable, "-m", "tooling.cli", *args], preexec_fn=_die_with_the_tether,
        stderr=subprocess.PIPE, text=True, errors="replace",
    )  # fmt: skip
    relay = StderrRelay(child.stderr)

    def stop(*_):
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                child.kill()

    signal.signal(signal.SIGTERM, lambda *_: (stop(), sys.exit(0)))
    while child.poll() is None:
        if os.getppid() != parent:  # reparented: the replica is gone
            stop()
            break
        time.sleep(POLL_S)
    code = child.wait()
    reason_file = os.environ.get(REASON_FILE_ENV)
    if code != 0 and reason_file:
        with open(reason_file, "w") as f:
            f.write(relay.reason())
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
