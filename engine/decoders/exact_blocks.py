"""Which blocks of a drafter's own cache hold entries it computed exactly, for the content
the blocks hold now.

EAGLE's, EAGLE-3's and Kangaroo's adapter's K/V of a token come from the target's features,
which exist only where the target computed that token. On a prefix-cache hit the target
computes nothing for the shared blocks, so the drafter can only reuse the entries that are
already in them: those of the request that filled the blocks, where its drafter read them.
Often it did not (the goodput policy drafts little on some machines, and a request that never
drafted never read its tokens), or the block id was handed to other content since and its
entries overwritten. Trusting those entries would have the drafter attend to another text's
K/V. So the drafter records, per block id, the chained content hash (the block manager's) of
the block whose entries it computed exactly, and trusts a hit block only when that hash is the
one the sequence now holds there; it reads the untrusted rest again (without the features it
never got: drafts lose accuracy there, never exactness).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sequence import CacheState


class ExactBlocks:
    """Block id -> content hash of the block whose entries a drafter computed exactly."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._content: dict[int, int] = {}

    def trusted_prefix(self, cache: CacheState) -> int:
        """Leading positions of a sequence whose entries were computed exactly for the
        content it holds (whole committed blocks)."""
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

    def record(self, cache: CacheState, exact_from: int, exact_to: int) -> int:
        """The entries of positions ``exact_from`` .. ``exact_to - 1`` were computed exactly:
        record the committed blocks that lie wholly inside. Returns where the next record of
        the sequence starts (past the blocks recorded now: each is recorded once)."""
        first = -(-exact_from // self.block_size)
        blocks = cache.committed_blocks(first, exact_to // self.block_size)
        self._content.update(blocks)
        return max(exact_from, (first + len(blocks)) * self.block_size)

    def __len__(self) -> int:
        return len(self._content)
