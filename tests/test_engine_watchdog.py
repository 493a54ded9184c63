"""The engine watchdog (issue 11 item 4): an engine process that is alive but no longer steps
(here a real one, stopped with SIGSTOP) is noticed while requests are in flight; they fail with
EngineDeadError saying it stalled, the process is killed and restarted, and the next request is
served. An idle engine, which reports nothing, is never taken for a stalled one."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from engine import SamplingParams
from engine.core_process import AsyncEngineClient, EngineDeadError
from tests.test_core_process import LONG, collect, tiny_config, wait_until

SHORT = SamplingParams(max_tokens=4, ignore_eos=True)


def test_a_stalled_engine_is_killed_failed_and_restarted(tiny_model_dir):
    async def main():
        client = AsyncEngineClient(tiny_config(tiny_model_dir), stall_timeout_s=2.0)
        await client.start()
        try:
            await asyncio.sleep(3.0)  # idle longer than the timeout: nothing happens
            assert client.ready and client.last_error is None
            first_pid = client.pid
            stream = client.generate("long", [5, 6, 7], LONG)
            await stream.__anext__()  # it is generating
            os.kill(first_pid, signal.SIGSTOP)  # alive, but it will never step again
            with pytest.raises(EngineDeadError, match="no progress"):
                async for _ in stream:
                    pass
            await wait_until(lambda: client.ready, timeout=60)
            assert client.pid != first_pid
            deltas = await collect(client, "after", [5, 6, 7], SHORT)
            assert deltas[-1].finished
        finally:
            await client.shutdown()

    asyncio.run(main())
