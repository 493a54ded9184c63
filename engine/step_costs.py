"""The target's forward time by step size, measured on the machine at hand.

The goodput policy (engine/draft_policy.py) weighs a step with drafts against one without, so
it needs the forward time of steps larger than any it has seen: a batch of 16 decoding with 2
drafts each is a 48-token step. Left to learn them online, it would have to run such a step
for the whole batch to find out, a slow step in every stream at once. Instead the engine times
decode-shaped steps once, before the policy's first choice: n sequences, one new token each.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.kv_cache import BlockManager
from engine.model_runner import ForwardItem, ModelRunner

# Step sizes timed; the policy interpolates between them and extends past the last.
STEP_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


@dataclass
class _Scratch:
    """A stand-in sequence holding one block while the steps are timed."""

    token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


def time_forward_steps(
    runner: ModelRunner, block_manager: BlockManager, max_tokens: int, repeats: int = 2
) -> dict[int, float]:
    """Seconds of the target's forward pass for steps of n tokens (the sizes of STEP_SIZES up
    to ``max_tokens``, and as many sequences as there are free blocks), fastest of ``repeats``
    after one warm-up. Each sequence has one block to itself: a block's worth of cached
    positions (whatever the blocks hold: the logits are thrown away) and the new token."""
    free = block_manager.num_free_blocks
    sizes = [n for n in STEP_SIZES if n <= min(max_tokens, free)]
    scratch = [_Scratch() for _ in range(max(sizes, default=0))]
    try:
        for seq in scratch:
            block_manager.append_slots(seq, 1)
        position = block_manager.block_size - 1
        seconds: dict[int, float] = {}
        for n in sizes:
            items = [ForwardItem([0], position, s.block_table, 1) for s in scratch[:n]]
            runner.run(items)
            best = float("inf")
            for _ in range(repeats):
                started = time.perf_counter()
                runner.run(items)
                best = min(best, time.perf_counter() - started)
            seconds[n] = best
        return seconds
    finally:
        for seq in scratch:
            block_manager.free(seq)
