"""Which blocks of a drafter's own cache hold entries it computed for the content the blocks
hold now.

EAGLE's, EAGLE-3's and Kangaroo's adapter's K/V of a token come from the target's features,
which exist only where the target computed that token. On a prefix-cache hit the target
computes nothing for the shared blocks, so the drafter can only reuse the entries that are
already in them: those of the request that filled the blocks, where its drafter read them.
Often it did not read all of them (the goodput policy drafts little on some machines, a request
that never drafted read nothing, the last tokens before a request ends are never read), or the
block id was handed to other content since and its entries overwritten. Reusing those would
have the drafter attend to another text's K/V, or to none. So the drafter records, per block
id, the chained content hash (the block manager's) of the block whose entries it computed, and
reuses a hit block only when that hash is the one the sequence now holds there; it reads the
rest of the hit again (without the features the target never computed there: those entries are
approximate, but the best any reader of that content can compute, so they are recorded too).
Drafts lose accuracy, never exactness.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sequence import CacheState


class WrittenBlocks:
    """Block id -> content hash of the block whose entries a drafter computed."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._content: dict[int, int] = {}

    def trusted_prefix(self, cache: CacheState) -> int:
        """Leading positions of a sequence whose entries were computed for the content it
        holds (whole committed blocks)."""
        blocks = 0
        for block_id, content in cache.committed_blocks():
            if self._content.get(block_id) != content:
                break
            blocks += 1
        return blocks * self.block_size

    def overwrite(self, block_table: list[int], first: int, count: int) -> None:
        """Entries of positions ``first`` .. ``first + count - 1`` are about to be written
        (through ``block_table``): the blocks they fall in no longer hold what was recorded."""
        if count <= 0:
            return
        last_block = min((first + count - 1) // self.block_size, len(block_table) - 1)
        for i in range(first // self.block_size, last_block + 1):
            self._content.pop(block_table[i], None)

    def record(self, cache: CacheState, written_from: int, written_to: int) -> int:
        """The entries of positions ``written_from`` .. ``written_to - 1`` stand for the
        sequence's content: record the committed blocks that lie wholly inside. Returns where
        the sequence's next record starts (past the blocks recorded now: each is recorded
        once)."""
        first = -(-written_from // self.block_size)
        if first >= written_to // self.block_size:  # no whole block inside: most steps
            return max(written_from, first * self.block_size)
        blocks = cache.committed_blocks(first, written_to // self.block_size)
        self._content.update(blocks)
        return max(written_from, (first + len(blocks)) * self.block_size)

    def __len__(self) -> int:
        return len(self._content)


def blocks_within(block_table: list[int], first: int, end: int, block_size: int) -> set[int]:
    """Ids of the blocks of ``block_table`` wholly inside positions ``first`` .. ``end - 1``."""
    return set(block_table[-(-first // block_size) : max(0, end) // block_size])


def past_fresh_blocks(
    block_table: list[int], first: int, limit: int, block_size: int, fresh: set[int]
) -> int:
    """Where a sequence about to re-read positions ``first`` .. ``limit - 1`` of a prefix hit
    from zeros may start instead: past the leading blocks that another sequence of the same
    pass writes from the target's features (``fresh``). A pass writes every row's K/V before
    its attention reads any, so those entries are there when it reads them; and two sequences
    writing one slot in a pass would leave either one's."""
    if first % block_size:
        return first
    while first + block_size <= limit and block_table[first // block_size] in fresh:
        first += block_size
    return first


def reads_past_fresh_blocks(
    plans: list[tuple[list[int], int, int, int, int]], block_size: int
) -> list[int]:
    """One pass's reads, each ``(block_table, read_from, features_from, end, hit_end)``: it
    writes positions ``read_from`` .. ``end - 1``, from the target's features from
    ``features_from`` on, and below ``hit_end`` (a prefix hit) from zeros. Returns each read's
    start, those re-reading a hit moved ``past_fresh_blocks`` of the others (unchanged when
    none re-reads a hit: the usual pass costs a comparison a sequence)."""
    starts = [read_from for _, read_from, _, _, _ in plans]
    if all(read_from >= hit_end for _, read_from, _, _, hit_end in plans):
        return starts
    fresh: set[int] = set()
    for table, read_from, features_from, end, _ in plans:
        fresh |= blocks_within(table, max(read_from, features_from), end, block_size)
    return [
        past_fresh_blocks(table, read_from, hit_end, block_size, fresh)
        if read_from < hit_end else read_from
        for table, read_from, _, _, hit_end in plans
    ]
