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


def main(argv: list[str]) -> int:
    parent, args = int(argv[0]), argv[2:]
    child = subprocess.Popen([sys.executable, "-m", "tooling.cli", *args])

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
