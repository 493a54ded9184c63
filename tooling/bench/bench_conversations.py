"""Multi-turn conversations against a running server: what prefix-aware routing is for.

    specserve bench serve --url URL --conversations 8 --turns 6

Each conversation opens with a long system prompt of its own and sends ``turns`` user turns
one after another, each carrying the whole history (its earlier questions and the server's
answers); the conversations run concurrently. Printed: mean and p50/p90 time to first token,
output tokens/s over the load, and the prefix-cache hit rate over the load (prompt tokens
found in the cache / looked up, from the server's ``/metrics`` before and after, summed over
replicas when the URL is a Ray Serve application). Run it against a cluster routed by prefix
and one routed by power of two choices (``specserve serve --replicas 2 --routing pow2``) to
compare them.

Real users pause between turns: ``think_time`` (mean seconds, exponential, seeded per
conversation) is waited before every turn, the first included, so conversations start and
move out of step. In lockstep (no think time) arrivals keep their order turn after turn, and
even Ray's power of two choices keeps a conversation where it was; apart, each turn meets
queues of other lengths and power of two choices moves it about half the time.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from server.ray_serve.proxied import REPLICA_HEADER
from tooling.bench.bench import TOPICS

HITS, QUERIES = "specserve:prefix_cache_hits", "specserve:prefix_cache_queries"


async def _prefix_counters(client: httpx.AsyncClient, url: str) -> tuple[float, float]:
    text = (await client.get(f"{url}/metrics")).text
    totals = {HITS: 0.0, QUERIES: 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in totals:
                totals[name] += sample.value
    return totals[HITS], totals[QUERIES]


def think_times(index: int, turns: int, mean_s: float, seed: int = 0) -> list[float]:
    """Seconds conversation ``index`` waits before each of its turns: exponential with mean
    ``mean_s`` (all zero when it is 0), the same for the same index and seed."""
    if mean_s <= 0:
        return [0.0] * turns
    rng = random.Random(f"{seed}:{index}")
    return [rng.expovariate(1.0 / mean_s) for _ in range(turns)]


def _system_prompt(index: int) -> str:
    topic = TOPICS[index % len(TOPICS)]
    facts = " ".join(f"Fact {i} about {topic}: it is worth a careful answer." for i in range(24))
    return f"You are a patient tutor on {topic} (conversation {index}). {facts}"




async def _turn(client, url, model, messages, max_tokens) -> tuple[float, str, int, str]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}}  # fmt: skip
    started, ttft, text, tokens = time.perf_counter(), None, [], 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        replica = response.headers.get(REPLICA_HEADER, "")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - started
                    text.append(piece)
    ttft = ttft if ttft is not None else time.perf_counter() - started
    return ttft, "".join(text), tokens, replica


async def run_conversations(url: str, model: str, conversations: int, turns: int,
                            max_tokens: int, think_time: float = 0.0) -> dict:  # fmt: skip
    """Returns ``ttft_mean``, ``ttft_p50``, ``ttft_p90`` (s), ``tokens_per_s`` and
    ``prefix_hit_rate`` of the load."""
    async with httpx.AsyncClient(timeout=600) as client:
        hits0, queries0 = await _prefix_counters(client, url)
        ttfts: list[float] = []
        tokens = [0]
        replicas: dict[int, list[str]] = {}  # conversation -> the replica of each turn

        async def conversation(index: int) -> None:
            messages = [{"role": "system", "content": _system_prompt(index)}]
            for turn, pause in enumerate(think_times(index, turns, think_time)):
                await asyncio.sleep(pause)
                messages.append({"role": "user", "content": f"Question {turn + 1}, please?"})
                ttft, text, count, replica = await _turn(client, url, model, messages,
                                                         max_tokens)  # fmt: skip
                replicas.setdefault(index, []).append(replica)
                ttfts.append(ttft)
                tokens[0] += count
                messages.append({"role": "assistant", "content": text})

        started = time.perf_counter()
        await asyncio.gather(*(conversation(i) for i in range(conversations)))
        seconds = time.perf_counter() - started
        hits1, queries1 = await _prefix_counters(client, url)
    looked_up = queries1 - queries0
    ttfts.sort()
    return {
        "ttft_mean": statistics.fmean(ttfts),
        "ttft_p50": ttfts[len(ttfts) // 2],
        "ttft_p90": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
        "tokens_per_s": tokens[0] / seconds,
        "prefix_hit_rate": (hits1 - hits0) / looked_up if looked_up else 0.0,
        # Turns served elsewhere than the conversation's previous turn; and how many
        # conversations each replica served first (empty names: not a Ray application).
        "moves": sum(t[i] != t[i + 1] for t in replicas.values() for i in range(len(t) - 1)),
        "first_turns": {r: [t[0] for t in replicas.values()].count(r)
                        for r in sorted({t[0] for t in replicas.values()})},  # fmt: skip
    }


def print_conversations(url: str, model: str, conversations: int, turns: int, max_tokens: int,
                        think_time: float = 0.0):  # fmt: skip
    result = asyncio.run(
        run_conversations(url, model, conversations, turns, max_tokens, think_time)
    )
    ms = {k: result[k] * 1e3 for k in ("ttft_mean", "ttft_p50", "ttft_p90")}
    print(
        f"{conversations} conversations x {turns} turns at {url}"
        + (f" (think time {think_time:g} s)" if think_time > 0 else "")
        + ": "
        f"prefix-cache hit rate {result['prefix_hit_rate']:.1%}, TTFT mean "
        f"{ms['ttft_mean']:.0f} ms (p50 {ms['ttft_p50']:.0f}, p90 {ms['ttft_p90']:.0f}), "
        f"{result['tokens_per_s']:.1f} output tok/s"
    )
    if any(result["first_turns"]):
        print(f"first turns per replica {result['first_turns']}; {result['moves']} of "
              f"{conversations * (turns - 1)} later turns went to another replica")  # fmt: skip
    return result
