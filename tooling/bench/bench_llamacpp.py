"""The llama.cpp baseline of ``specserve bench offline``: llama-cpp-python on the model's GGUF.

It measures the bench's three figures (decode tokens/s at batch 1 and batch N, TTFT of a long
prompt) with the same token ids, thread count and greedy decoding as our engine. llama-cpp-python
is an optional extra (``specserve[bench]``): without it, or without a GGUF file, every figure is
``None`` and a one-line note says why, so the bench still prints ours and transformers'.

llama.cpp runs in a child process: a crash inside it (its multi-token prompt evaluation crashed
on an Intel AMX VM) becomes a note instead of killing the bench.
"""

from __future__ import annotations

import itertools
import multiprocessing
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.toolkit import find_gguf  # noqa: F401  (re-exported: the dir's GGUF)

INSTALL_NOTE = "llama.cpp skipped: pip install 'specserve[bench]'"
NO_GGUF_NOTE = "llama.cpp skipped: no single *.gguf in the model directory (pass --gguf PATH)"
# The high-level API owns one sequence; N sequential streams would not be batched decoding.
BATCH_NOTE = "llama-cpp-python runs one sequence at a time"


@dataclass
class LlamaCppFigures:
    """The bench's rows for llama.cpp (None: not measured) and notes to print under the table."""

    decode_1: float | None = None
    decode_n: float | None = None
    ttft_s: float | None = None
    notes: list[str] = field(default_factory=list)

    def rows(self) -> list[float | None]:
        return [self.decode_1, self.decode_n, self.ttft_s]


def llama_class():
    """llama_cpp.Llama, or None when the optional extra is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    return Llama


def load_llama(gguf: Path, threads: int, n_ctx: int, n_batch: int):
    """A llama.cpp context on ``gguf`` with our thread count for decode and prompt alike."""
    return llama_class()(
        model_path=str(gguf),
        n_ctx=n_ctx,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=n_batch,
        # The physical batch too: n_batch=1 must really evaluate one token per call (the
        # multi-token prompt path is what crashed on some AMX machines).
        n_ubatch=n_batch,
        logits_all=False,
        verbose=False,
    )


def _greedy_stream(llama, prompt: list[int]):
    # reset() sets n_tokens to 0, so generate() skips its prefix reuse and its first eval drops
    # every KV cell: each call starts from an empty cache. temp=0 is llama.cpp's greedy sampler;
    # generate() itself never stops at EOS, so the caller decides how many tokens to take.
    llama.reset()
    return llama.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0)


def greedy_decode(llama, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """``max_tokens`` greedy tokens (EOS ignored) and the decode tokens/s, which, as ours,
    counts the tokens after the first over the time they took."""
    stream = _greedy_stream(llama, prompt)
    tokens = [next(stream)]
    start = time.perf_counter()
    tokens += itertools.islice(stream, max_tokens - 1)
    elapsed = time.perf_counter() - start
    stream.close()
    return tokens, (len(tokens) - 1) / max(elapsed, 1e-9)


def prompt_ttft(llama, prompt: list[int], repeats: int = 3) -> float:
    """Median seconds to evaluate ``prompt`` from an empty KV cache and sample the first token."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        stream = _greedy_stream(llama, prompt)
        next(stream)
        times.append(time.perf_counter() - start)
        stream.close()
    return statistics.median(times)


def llamacpp_baseline(
    gguf: Path | None,
    prompts: list[list[int]],
    long_prompt: list[int],
    max_tokens: int,
    threads: int,
    n_batch: int = 512,
) -> LlamaCppFigures:
    """The bench's three figures for llama.cpp, or a note saying why there are none."""
    if llama_class() is None:
        return LlamaCppFigures(notes=[INSTALL_NOTE])
    if gguf is None:
        return LlamaCppFigures(notes=[NO_GGUF_NOTE])
    return run_isolated(_measure, gguf, prompts, long_prompt, max_tokens, threads, n_batch)


def _measure(gguf, prompts, long_prompt, max_tokens, threads, n_batch) -> LlamaCppFigures:
    n_ctx = max(len(p) for p in [*prompts, long_prompt]) + max_tokens
    try:
        llama = load_llama(gguf, threads, n_ctx, n_batch)
    except ValueError as err:  # llama-cpp-python's error for a missing or unreadable file
        return LlamaCppFigures(notes=[f"llama.cpp skipped: {err}"])
    try:
        greedy_decode(llama, prompts[0], 4)  # warm-up: pages in the mmapped weights
        decode_1 = greedy_decode(llama, prompts[0], max_tokens)[1]
        ttft = prompt_ttft(llama, long_prompt)
    finally:
        llama.close()
    figures = LlamaCppFigures(decode_1, decode_1 if len(prompts) == 1 else None, ttft)
    figures.notes.append(f"llama.cpp: {gguf}, {threads} threads, n_batch {n_batch}")
    if len(prompts) > 1:
        figures.notes.append(f"llama.cpp batch {len(prompts)}: - ({BATCH_NOTE})")
    return figures


def _child(conn, fn, args) -> None:
    conn.send(fn(*args))
    conn.close()


def run_isolated(fn, *args) -> LlamaCppFigures:
    """``fn(*args)`` in a fresh process (spawned: no forked OpenMP state); a crash is a note."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(send, fn, args), daemon=True)
    child.start()
    send.close()
    try:
        figures = receive.recv()
    except EOFError:  # the child died before answering
        figures = None
    child.join()
    if figures is None:
        return LlamaCppFigures(
            notes=[
                f"llama.cpp crashed (exit code {child.exitcode}); if it was the prompt "
                "evaluation, try --llamacpp-n-batch 1"
            ]
        )
    return figures
