"""What keeps one request or one engine fault from hurting the rest (issue 11 items 4 and 6).

The watchdog: an engine process that is alive but no longer steps (here a real one, stopped
with SIGSTOP) is noticed while requests are in flight; they fail with EngineDeadError saying it
stalled, the process is killed and restarted, and the next request is served. An idle engine,
which reports nothing, is never taken for a stalled one.

Backpressure: a consumer that stops reading is cut off once its undelivered outputs reach the
bound (StreamBacklogError after what was queued), its request is aborted and its KV blocks
freed, while another request on the same engine goes on."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from engine import SamplingParams
from engine.core_process import AsyncEngineClient, EngineDeadError, StreamBacklogError
from tests.test_core_process import LONG, all_blocks_free, collect, tiny_config, wait_until

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


def test_a_consumer_that_stops_reading_is_cut_off_and_its_blocks_freed(tiny_model_dir):
    async def main():
        client = AsyncEngineClient(tiny_config(tiny_model_dir), max_stream_backlog=8)
        await client.start()
        try:
            stalled = client.generate("stalled", [5, 6, 7], LONG)
            await stalled.__anext__()
            # Another request, read as it comes, while the first one's reader sleeps.
            deltas = await collect(client, "reader", [8, 9, 10], SamplingParams(
                max_tokens=40, ignore_eos=True))  # fmt: skip
            assert sum(len(c.new_token_ids) for d in deltas for c in d.choices) == 40
            received = 1
            with pytest.raises(StreamBacklogError, match="8 outputs behind"):
                async for _ in stalled:
                    received += 1
            assert received <= 1 + 8  # what was queued, then the error
            await wait_until(lambda: all_blocks_free(client) and client.num_in_flight == 0)
            assert client.ready  # the engine itself was never disturbed
        finally:
            await client.shutdown()

    asyncio.run(main())


def test_a_multi_prompt_request_whose_reader_stops_is_cut_off_whole(tiny_chat_model_dir):
    """A completion with several prompts is bounded as one prompt is: its streams back up to
    the client's bound and every prompt's sequence is aborted, and the reader, when it reads
    again, gets the client_too_slow ending for every choice still open."""
    from engine.fast_tokenizer import FastTokenizer
    from server.generation import RequestRun
    from server.metrics import ServerMetrics

    tokenizer = FastTokenizer(tiny_chat_model_dir)

    async def main():
        client = AsyncEngineClient(tiny_config(tiny_chat_model_dir), max_stream_backlog=8)
        await client.start()
        try:
            metrics = ServerMetrics("tiny", lambda: client.stats)
            run = RequestRun("cmpl-x", [[5, 6, 7], [8, 9, 10], [11, 12]], LONG, [], client,
                             tokenizer, metrics)  # fmt: skip
            events = run.events()
            await events.__anext__()  # reading has started, then the reader stops
            await wait_until(lambda: all_blocks_free(client) and client.num_in_flight == 0,
                             timeout=30)  # fmt: skip
            with pytest.raises(StreamBacklogError):
                async for _ in events:
                    pass
            assert sorted(run.finish_reasons.values()) == ["client_too_slow"] * 3
        finally:
            await client.shutdown()

    asyncio.run(main())
