"""``python -m server.ray_serve.tethered PARENT_PID NAME ARGS...``: run ``specserve ARGS...``
for as long as process PARENT_PID lives (NAME, the replica's, only labels the process).

A replica's server must not outlive its replica: Ray kills a failed or scaled-down replica's
actor outright (no destructor runs), and a server left behind would hold its port, its engine
process and its memory. The tether polls its parent and, once it is gone, stops the server as a
signal would (open streams get their error event, the engine process exits), killing it if
it has not gone within its shutdown time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

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


def main(argv: list[str]) -> int:
    parent, args = int(argv[0]), argv[2:]
    child = subprocess.Popen(
        [sys.executable, "-m", "tooling.cli", *args], preexec_fn=_die_with_the_tether
    )

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
    return child.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
