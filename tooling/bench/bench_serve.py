"""Serving benchmark: concurrent streaming chat requests against specserve and, in the same run,
against ``transformers serve --continuous-batching`` on the same model.

Reports output tokens/s over the whole load, and p50/p90/p99 of time to first token and of
inter-token latency (gaps between content chunks). Output tokens are counted by tokenizing each
response's text with the model's tokenizer, so both servers are measured the same way; the
decoder sweep, whose requests ask for usage, takes the server's own counts.

The decoder sweep also reads ITL per token: a speculative step streams the tokens it accepted
in one chunk, so a gap between chunks can stand for several tokens. With vLLM's continuous
usage stats each chunk says how many tokens it covers, and its gap is shared out among them
(SGLang's bench divides by the accepted length the same way).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tooling.bench.bench import TOPICS

TRANSFORMERS_CLI = os.path.join(os.path.dirname(sys.executable), "transformers")


@dataclass
class StreamResult:
    ttft: float
    gaps: list[float]  # between content chunks
    text: str
    # One per token after the first chunk, each its chunk's gap over the chunk's tokens; empty
    # unless the chunks carried usage so far (stream_options.continuous_usage_stats).
    token_gaps: list[float] = field(default_factory=list)
    # The server's own count (the last usage it sent), if it sent usage.
    completion_tokens: int | None = None


def shared_gaps(gap: float, tokens: int) -> list[float]:
    """A chunk's gap shared out among the ``tokens`` it covers (at least one: a chunk with text
    and no new token can only be text the detokenizer held back, which came with the last)."""
    tokens = max(tokens, 1)
    return [gap / tokens] * tokens


@dataclass
class LoadResult:
    name: str
    wall: float
    results: list[StreamResult] = field(default_factory=list)

    def output_tokens(self, tokenizer) -> int:
        """The servers' own counts where every stream reported usage (exact, whatever model the
        server runs); else the text re-tokenized with ``tokenizer``."""
        if self.results and all(r.completion_tokens is not None for r in self.results):
            return sum(r.completion_tokens for r in self.results)
        return sum(len(tokenizer.encode(r.text, add_special_tokens=False)) for r in self.results)


def chat_messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Tell me a story about {TOPICS[i % len(TOPICS)]}."}]


async def one_stream(client: httpx.AsyncClient, url: str, body: dict) -> StreamResult:
    start = time.perf_counter()
    ttft, last, gaps, text, token_gaps, counted, reported = None, None, [], [], [], 0, None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            tokens_so_far = (chunk.get("usage") or {}).get("completion_tokens")
            reported = tokens_so_far if tokens_so_far is not None else reported
            content = "".join(c.get("delta", {}).get("content") or "" for c in chunk["choices"])
            if not content:
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft = now - start
            else:
                gaps.append(now - last)
                if tokens_so_far is not None:
                    token_gaps += shared_gaps(now - last, tokens_so_far - counted)
            last = now
            counted = tokens_so_far if tokens_so_far is not None else counted
            text.append(content)
    ttft = ttft if ttft is not None else float("nan")
    return StreamResult(ttft, gaps, "".join(text), token_gaps, reported)


async def run_load(
    name: str,
    url: str,
    model: str,
    concurrency: int,
    requests: int,
    max_tokens: int,
    extra: dict | None = None,
) -> LoadResult:
    """``requests`` streaming chats, ``concurrency`` at a time; ``extra`` joins every body."""
    extra = extra or {}
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        gate = asyncio.Semaphore(concurrency)

        async def task(i: int) -> StreamResult:
            body = {
                "model": model,
                "messages": chat_messages(i),
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                **extra,
            }
            async with gate:
                return await one_stream(client, url, body)

        # One request first, unmeasured: both servers do lazy set-up on their first request.
        warm = {"model": model, "messages": chat_messages(0), "max_tokens": 4, "stream": True}
        warm |= extra
        await one_stream(client, url, warm)
        start = time.perf_counter()
        results = await asyncio.gather(*(task(i) for i in range(requests)))
        return LoadResult(name, time.perf_counter() - start, list(results))


def percentiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        v = values[0] if values else float("nan")
        return v, v, v
    q = statistics.quantiles(values, n=100, method="inclusive")
    return q[49], q[89], q[98]


def report(load: LoadResult, tokenizer) -> dict[str, float]:
    tokens = load.output_tokens(tokenizer)
    ttft = percentiles([r.ttft for r in load.results])
    itl = percentiles([g for r in load.results for g in r.gaps])
    row = {"tokens_per_s": tokens / load.wall, "ttft": ttft, "itl": itl, "tokens": tokens}
    print(
        f"| {load.name} | {tokens} | {load.wall:.1f} | {row['tokens_per_s']:.1f} | "
        f"{ttft[0] * 1e3:.0f} / {ttft[1] * 1e3:.0f} / {ttft[2] * 1e3:.0f} | "
        f"{itl[0] * 1e3:.0f} / {itl[1] * 1e3:.0f} / {itl[2] * 1e3:.0f} |"
    )
    return row


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: list[str], url: str, log_path: str, timeout: float = 300):
    log = open(log_path, "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited early; see {log_path}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return proc
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{' '.join(cmd)} did not become healthy; see {log_path}")
    except BaseException:
        # Not handed back, so nobody else stops it: a timeout or a Ctrl-C while it loads must
        # not leave a server (in its own session, out of the terminal's reach) behind.
        stop_server(proc)
        raise


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class LoadSpec:
    concurrency: int
    requests: int
    max_tokens: int


def measure(
    name: str, cmd: list[str] | None, url: str, model: str, spec: LoadSpec, tokenizer, log_dir: str
) -> dict:
    """Start the server (unless ``cmd`` is None: already running at ``url``), run the load,
    print its row, stop the server."""
    proc = None
    if cmd is not None:
        proc = start_server(cmd, url, f"{log_dir}/{name.split()[0]}-bench-serve.log")
    try:
        load = asyncio.run(
            run_load(name, url, model, spec.concurrency, spec.requests, spec.max_tokens)
        )
        return report(load, tokenizer)
    finally:
        if proc is not None:
            stop_server(proc)


def served_model(url: str) -> str:
    """The model id a running server answers to (its first in ``/v1/models``): a server
    started by ``make serve`` serves the embedded model under its short name, one started
    with ``--served-model-name`` under that."""
    return served_decoders(url).model


def run_serve_bench(
    model: str | None,
    config: str | None,
    spec: LoadSpec,
    with_baseline: bool,
    url: str | None,
    log_dir: str = "/tmp",
) -> None:
    """The same load against specserve (started here unless ``url`` is given) and then
    against ``transformers serve --continuous-batching``, one server at a time."""
    from engine.toolkit import load_tokenizer, resolve_model

    model_dir = str(resolve_model(model or "smollm2-135m-instruct"))
    tokenizer = load_tokenizer(Path(model_dir))
    print(
        f"model {model_dir}; {spec.requests} streaming chat requests, {spec.concurrency} "
        f"concurrent, max_tokens {spec.max_tokens}, greedy\n"
    )
    print(
        "| server | output tokens | wall s | output tok/s | TTFT p50/p90/p99 ms | "
        "ITL p50/p90/p99 ms |\n|---|---|---|---|---|---|"
    )
    if url is not None:
        ours = measure("specserve", None, url, served_model(url), spec, tokenizer, log_dir)
    else:
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "tooling.cli",
            "serve",
            "--port",
            str(port),
            "--model",
            model_dir,
            "--served-model-name",
            "bench",
        ]
        cmd += ["--config", config] if config else []
        ours = measure(
            "specserve", cmd, f"http://127.0.0.1:{port}", "bench", spec, tokenizer, log_dir
        )
    if not with_baseline:
        return
    port = free_port()
    cmd = [
        TRANSFORMERS_CLI,
        "serve",
        model_dir,
        "--continuous-batching",
        "--device",
        "cpu",
        "--port",
        str(port),
    ]
    theirs = measure(
        "transformers serve --continuous-batching",
        cmd,
        f"http://127.0.0.1:{port}",
        model_dir,
        spec,
        tokenizer,
        log_dir,
    )
    throughput = ours["tokens_per_s"] / theirs["tokens_per_s"]
    ttft = theirs["ttft"][0] / ours["ttft"][0]
    print(
        f"\nspecserve vs transformers: {throughput:.2f}x output tok/s, {ttft:.2f}x lower p50 TTFT"
    )


def draft_lengths_chosen(url: str, method: str) -> dict[int, float]:
    """The server's count of steps per draft length the goodput policy chose for ``method``
    (empty when the policy is off), from its Prometheus text."""
    return parse_draft_lengths(httpx.get(url + "/metrics", timeout=10).text, method)


def parse_draft_lengths(text: str, method: str) -> dict[int, float]:
    """Steps per chosen draft length for ``method`` in Prometheus text: its own series, and
    those of its draft sources (``hybrid:lookup``, ``hybrid:hydra``) summed."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "specserve:spec_decode_draft_length_chosen":
            continue
        for sample in family.samples:
            decoder = sample.labels.get("decoder", "")
            if sample.name.endswith("_total") and decoder.partition(":")[0] == method:
                length = int(sample.labels["length"])
                counts[length] = counts.get(length, 0.0) + sample.value
    return counts


def policy_summary(chosen: dict[int, float]) -> str:
    """ "share of steps with no drafts | mean chosen length" for a run's policy choices."""
    steps = sum(chosen.values())
    if not steps:
        return "- | -"
    mean = sum(k * n for k, n in chosen.items()) / steps
    return f"{chosen.get(0, 0.0) / steps:.0%} | {mean:.2f}"


def run_concurrency_sweep(
    model: str | None,
    config: str | None,
    method: str,
    concurrencies: list[int],
    requests_per_stream: int,
    max_tokens: int,
    log_dir: str = "/tmp",
    rounds: int = 2,
    url: str | None = None,
) -> None:
    """One specserve server (its config loads ``method``; started here unless ``url`` is
    given): at each concurrency, the same load with every request on plain autoregressive
    decoding and on ``method`` (chosen per request), one table row per concurrency.

    The load runs ``rounds`` times per method, the two alternating A B, B A, A B, ... so that a
    machine slowing down or speeding up during the row (these shared VMs drift by 10-20%
    within a minute) weighs on both alike; a row's tok/s is its tokens over its seconds summed
    over the rounds, and its ITL percentiles are over every round's gaps. The ITL p99 ratio
    (method over autoregressive) comes with its range over the rounds, each round's ratio from
    that round's gaps alone: how much of a difference is the machine's noise. ITL is read twice:
    as gaps between chunks, and per token (each gap shared among the tokens its chunk covers),
    which is what a drafted step's several tokens in one chunk cost each of them. The last
    column sets the autoregressive load's rounds that ran second against those that ran first:
    identical decoding, so the noise any ratio of the row has to clear."""
    from engine.toolkit import load_tokenizer, resolve_model

    model_dir = str(resolve_model(model or "smollm2-135m-instruct"))
    tokenizer = load_tokenizer(Path(model_dir))
    proc = None
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "tooling.cli", "serve", "--port", str(port), "--model",
               model_dir, "--served-model-name", "bench"]  # fmt: skip
        cmd += ["--config", config] if config else ["--decoder", method]
        where = f"config {config or '--decoder ' + method}"
        proc = start_server(cmd, url, f"{log_dir}/sweep-bench-serve.log")
    else:
        url = url.rstrip("/")
        where = f"the server at {url}"
    try:
        served = served_decoders(url)
        if method not in served.decoders:
            raise ValueError(
                f"{where} does not load {method!r} (it has {', '.join(served.decoders)}): "
                f"start it with --extra-decoders {method} or a config that loads it"
            )
        print(
            f"model {model_dir}; {where}; streaming chat, {requests_per_stream} requests per "
            f"stream, max_tokens {max_tokens}, greedy, {rounds} alternating rounds per method\n"
        )
        _sweep(url, served.model, tokenizer, method, concurrencies, requests_per_stream,
               max_tokens, rounds)  # fmt: skip
    finally:
        if proc is not None:
            stop_server(proc)


@dataclass
class ServedDecoders:
    model: str  # the id requests name
    decoders: list[str]  # what "speculative": {"method": ...} may pick


def served_decoders(url: str) -> ServedDecoders:
    """A running server's model id and the decoders it loaded (its ``/v1/models`` card)."""
    response = httpx.get(url.rstrip("/") + "/v1/models", timeout=30)
    response.raise_for_status()
    card = response.json()["data"][0]
    if "decoders" not in card:  # the card lists them once the engine is up
        raise RuntimeError(f"the server at {url} is not ready (its engine is still loading)")
    return ServedDecoders(card["id"], list(card["decoders"]))


# Every chunk carries usage so far, so the sweep can share each gap among the chunk's tokens.
PER_TOKEN_USAGE = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}


@dataclass
class SweepRound:
    tokens: int
    seconds: float
    gaps: list[float]  # between chunks
    token_gaps: list[float]  # per token


@dataclass
class SweepRow:
    """One method's load at one concurrency: its rounds, and their sums."""

    rounds: list[SweepRound] = field(default_factory=list)

    def add(self, load: LoadResult, tokenizer) -> tuple[float, float]:
        """Adds a round; returns its own p99 of chunk gaps and of per-token gaps."""
        gaps = [g for res in load.results for g in res.gaps]
        token_gaps = [g for res in load.results for g in res.token_gaps]
        self.rounds.append(SweepRound(load.output_tokens(tokenizer), load.wall, gaps, token_gaps))
        return percentiles(gaps)[2], percentiles(token_gaps)[2]

    @property
    def rate(self) -> float:
        return sum(r.tokens for r in self.rounds) / sum(r.seconds for r in self.rounds)

    def all(self, which: str) -> list[float]:
        """Every round's ``gaps`` or ``token_gaps``."""
        return [g for r in self.rounds for g in getattr(r, which)]

    def against_itself(self) -> str:
        """The same load compared with itself: tok/s and per-token ITL p99 of rounds 2, 4, ...
        over rounds 1, 3, ... (in the sweep, the autoregressive load's rounds run second
        against those run first); "-" with fewer than two rounds. Identical work, so whatever
        it reads is the machine's noise and the order within a round, the yardstick for the
        row's ratios."""
        halves = [SweepRow(self.rounds[1::2]), SweepRow(self.rounds[0::2])]
        if not all(h.rounds for h in halves):
            return "-"
        later, earlier = halves
        p99 = [percentiles(h.all("token_gaps"))[2] for h in halves]
        return f"{ratio_text(later.rate / earlier.rate)} / {ratio_text(p99[0] / p99[1])}"


def ratio_text(ratio: float) -> str:
    """``1.23x``; a ratio too small for two decimals in two significant digits (a loaded
    machine can make one half's few gaps tiny: "0.00x" read as nothing), "-" for no number."""
    if not math.isfinite(ratio) or ratio <= 0:
        return "-"
    return f"{ratio:.2f}x" if ratio >= 0.01 else f"{ratio:.2g}x"


def _sweep(url, model, tokenizer, method, concurrencies, requests_per_stream, max_tokens, rounds):
    """The table rows of ``run_concurrency_sweep`` against the running server at ``url``."""
    print(
        f"| streams | autoregressive tok/s | {method} tok/s | ratio | ITL p50/p99 ms "
        f"autoregressive | ITL p50/p99 ms {method} | ITL p99 ratio | per-token ITL p50/p99 ms "
        f"autoregressive | per-token ITL p50/p99 ms {method} | per-token ITL p99 ratio | "
        f"{method} steps plain | {method} mean draft length | autoregressive against itself: "
        "tok/s / per-token ITL p99 (run second over run first) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    for c in concurrencies:
        rows = {"autoregressive": SweepRow(), method: SweepRow()}
        # Each round's p99 ratios (chunk gaps, per-token gaps): how far one round's reading
        # strays from the row's.
        round_ratios: tuple[list[float], list[float]] = ([], [])
        lengths_before = draft_lengths_chosen(url, method)
        for r in range(rounds):
            round_p99 = {}
            order = ("autoregressive", method) if r % 2 == 0 else (method, "autoregressive")
            for name in order:
                extra = {"speculative": {"method": name}, **PER_TOKEN_USAGE}
                load = asyncio.run(
                    run_load(name, url, model, c, c * requests_per_stream, max_tokens, extra)
                )
                round_p99[name] = rows[name].add(load, tokenizer)
            for i, ratios in enumerate(round_ratios):
                ratio = round_p99[method][i] / round_p99["autoregressive"][i]
                if not math.isnan(ratio):  # a round whose streams sent one chunk each has no gap
                    ratios.append(ratio)
        after = draft_lengths_chosen(url, method)
        chosen = {k: after[k] - lengths_before.get(k, 0.0) for k in after}
        plain, spec = rows["autoregressive"], rows[method]
        rate = {n: row.rate for n, row in rows.items()}
        cells = [
            str(c),
            f"{rate['autoregressive']:.1f}",
            f"{rate[method]:.1f}",
            f"{rate[method] / rate['autoregressive']:.2f}x",
        ]
        for which, ratios in (("gaps", round_ratios[0]), ("token_gaps", round_ratios[1])):
            plain_itl, spec_itl = (percentiles(row.all(which)) for row in (plain, spec))
            cells += [
                f"{plain_itl[0] * 1e3:.1f} / {plain_itl[2] * 1e3:.1f}",
                f"{spec_itl[0] * 1e3:.1f} / {spec_itl[2] * 1e3:.1f}",
                f"{spec_itl[2] / plain_itl[2]:.2f}x {_spread(ratios)}",
            ]
        print(f"| {' | '.join(cells)} | {policy_summary(chosen)} | {plain.against_itself()} |")


def _spread(ratios: list[float]) -> str:
    """ "(lowest-highest)" of the rounds' ratios; "(-)" if no round had gaps to compare."""
    if not ratios:
        return "(-)"
    return "({}-{})".format(
        *(f"{r:.2f}" if r >= 0.1 else f"{r:.3f}" for r in (min(ratios), max(ratios)))
    )
