"""The target's forward time by step size and context, measured on the machine at hand.

The goodput policy (engine/draft_policy.py) weighs a step with drafts against one without, so
it needs the forward time of steps larger than any it has seen: a batch of 16 decoding with 2
drafts each is a 48-token step. Left to learn them online, it would have to run such a step
for the whole batch to find out, a slow step in every stream at once. Instead the engine times
decode-shaped steps once, before the policy's first choice: n sequences, one new token each,
after a block's worth of cached tokens; and a few sizes again after ``LONG_CONTEXT`` tokens,
for the cost of attending to more keys (drafts attend to their whole sequence).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.draft_policy import StepTimings
from engine.kv_cache import BlockManager
from engine.model_runner import ForwardItem, ModelRunner

# Step sizes timed; the policy interpolates between them and extends past the last.
STEP_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
LONG_SIZES = (1, 4, 16)
# The cost of a key is a small difference of two step times (at 256 keys a third of a
# millisecond in a 3 ms step on a 2-core VM), so it is measured far out and more often: at
# 256 keys and two repeats, calibrations read 2.4-2.9 us per key where interleaved best-of-15
# timings gave 1.5-1.75, and the policy priced a draft's attention 1.5x too high.
LONG_CONTEXT = 512
LONG_REPEATS = 4
# A process just loaded runs its first steps 15-30% slower for a while (measured on a 2-core
# VM: 3.3-3.7 ms against 2.8-2.9 ms for one token). Timed inside that while, size 1 looked so
# slow that a 2-token step seemed 0.95-1.09x one token where it is 1.15-1.20x, and the policy
# drafted at a loss; so one-token steps first run untimed for this long.
WARM_UP_SECONDS = 0.2
# The sizes a batch-1 stream drafts at decide whether a draft pays: their differences are a
# tenth of a step. Timed back to back, twice each, one size's two repeats fell in the same
# slow or fast spell of a noisy 2-core VM, and six calibrations of one engine read 2 tokens at
# 1.04-1.23x one token (a row priced from nearly free to a fifth of a step). So the sizes are
# timed in rounds, each size once a round, and the small ones in more rounds.
SMALL_SIZES_UP_TO = 8
SMALL_REPEATS = 6


@dataclass
class _Scratch:
    """A stand-in sequence holding blocks while the steps are timed."""

    token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


def _seconds(runner: ModelRunner, items: list[ForwardItem]) -> float:
    started = time.perf_counter()
    logits = runner.run(items)
    if logits.is_cuda:  # a GPU runs the pass after run() returns: time its end
        torch.cuda.synchronize(logits.device)
    return time.perf_counter() - started


def _fastest_in_rounds(runner: ModelRunner, steps: dict[int, list], repeats: dict[int, int]):
    """The fastest time of each step (by size), each run once a round for its ``repeats``
    rounds after one untimed run, so that a slow spell of the machine falls on all sizes."""
    for items in steps.values():
        runner.run(items)  # warm-up
    best = dict.fromkeys(steps, float("inf"))
    for round_ in range(max(repeats.values(), default=0)):
        for n, items in steps.items():
            if round_ < repeats[n]:
                best[n] = min(best[n], _seconds(runner, items))
    return best


def _run_for(runner: ModelRunner, items: list[ForwardItem], seconds: float) -> None:
    """Run ``items`` over and over for ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        logits = runner.run(items)
        if logits.is_cuda:  # a GPU would queue far more than ``seconds`` of work otherwise
            torch.cuda.synchronize(logits.device)


def _timings(
    runner, block_manager, sizes, context: int, repeats: int, warm_up: float = 0.0
) -> dict[int, float]:
    """Steps of n sequences, one new token each after ``context`` cached positions (whatever
    their blocks hold: the logits are thrown away), for each n of ``sizes`` that the free
    blocks allow."""
    blocks_each = context // block_manager.block_size + 1
    most = block_manager.num_free_blocks // blocks_each
    sizes = [n for n in sizes if n <= most]
    scratch = [_Scratch() for _ in range(max(sizes, default=0))]
    try:
        for seq in scratch:
            block_manager.append_slots(seq, context + 1)
        if sizes and warm_up:  # see WARM_UP_SECONDS
            _run_for(runner, [ForwardItem([0], context, scratch[0].block_table, 1)], warm_up)
        steps = {
            n: [ForwardItem([0], context, s.block_table, 1) for s in scratch[:n]] for n in sizes
        }
        rounds = {
            n: max(repeats, SMALL_REPEATS) if n <= SMALL_SIZES_UP_TO else repeats for n in sizes
        }
        return _fastest_in_rounds(runner, steps, rounds)
    finally:
        for seq in scratch:
            block_manager.free(seq)


def time_forward_steps(
    runner: ModelRunner,
    block_manager: BlockManager,
    max_tokens: int,
    max_model_len: int,
    repeats: int = 2,
) -> StepTimings:
    """The policy's calibration: step sizes up to ``max_tokens`` (of STEP_SIZES) at a short
    context, LONG_SIZES at LONG_CONTEXT keys (fewer where ``max_model_len`` is shorter); the
    fastest of ``repeats`` rounds (LONG_REPEATS far out, SMALL_REPEATS for the small sizes)
    after a warm-up."""
    short_context = block_manager.block_size - 1
    long_context = min(LONG_CONTEXT, max_model_len - 1)  # the model's positions end there
    sizes = [n for n in STEP_SIZES if n <= max_tokens]
    short = _timings(runner, block_manager, sizes, short_context, repeats, WARM_UP_SECONDS)
    long_sizes = [n for n in LONG_SIZES if n <= max_tokens]
    long = _timings(
        runner, block_manager, long_sizes, long_context, max(repeats, LONG_REPEATS), WARM_UP_SECONDS
    )
    return StepTimings(short, short_context, long, long_context)
