"""A periodic log line of speculative decoding, per decoder (as vLLM logs its SpecDecoding
metrics): drafts, acceptance rate and mean acceptance length since the previous line.

Logged only when something was drafted in the interval, so an idle server stays quiet.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

log = logging.getLogger("specserve.spec_decode")


def log_interval_s() -> float:
    """Seconds between lines: 10, or ``SPECSERVE_SPEC_LOG_INTERVAL_S``."""
    return float(os.environ.get("SPECSERVE_SPEC_LOG_INTERVAL_S", "10"))


def spec_log_lines(previous: dict, current: dict) -> list[str]:
    """One line per decoder whose counters moved from ``previous`` to ``current`` (both
    ``{decoder: (drafts, draft_tokens, accepted, per_position)}``)."""
    lines = []
    for decoder, (drafts, draft_tokens, accepted, per_position) in current.items():
        old = previous.get(decoder, (0, 0, 0, ()))
        runs, proposed, taken = drafts - old[0], draft_tokens - old[1], accepted - old[2]
        if runs <= 0:
            continue
        old_pos = tuple(old[3]) + (0,) * (len(per_position) - len(old[3]))
        per_pos = ", ".join(
            f"{(now - before) / runs:.2f}"
            for now, before in zip(per_position, old_pos, strict=True)
        )
        lines.append(
            f"spec decode: decoder={decoder} drafts={runs} draft_tokens={proposed} "
            f"accepted={taken} acceptance_rate={taken / proposed if proposed else 0:.3f} "
            f"mean_acceptance_length={1 + taken / runs:.2f} "
            f"per_position_acceptance=[{per_pos}]"
        )
    return lines


async def log_spec_decode(totals: Callable[[], object], interval_s: float | None = None):
    """Run until cancelled: every ``interval_s``, log what ``totals().spec_by_decoder`` gained."""
    interval_s = log_interval_s() if interval_s is None else interval_s
    previous: dict = {}
    while True:
        await asyncio.sleep(interval_s)
        current = dict(getattr(totals(), "spec_by_decoder", ()) or ())
        for line in spec_log_lines(previous, current):
            log.info(line)
        previous = current
