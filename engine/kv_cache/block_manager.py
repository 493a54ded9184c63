"""Paged KV-cache bookkeeping: fixed-size blocks, a free list, reference counts, and a prefix
cache keyed by a chained hash of full blocks.

The block manager only counts; it never touches the K/V tensors. A sequence owns a
*block table* (block ids in position order). Blocks whose tokens are all computed get a
hash of (previous block's hash, their tokens), so a later prompt with the same prefix can
reuse them. A block whose reference count drops to zero goes back to the free list but
keeps its hash until it is handed out again: a freed prefix can still be revived.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class CachedSequence(Protocol):
    """What the block manager reads and writes on a sequence."""

    token_ids: list[int]
    block_table: list[int]
    block_hashes: list[int]  # chained hashes of the full, committed blocks of block_table
    num_computed_tokens: int


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    # What the hash stands for, compared on every hit so that a hash collision can never
    # hand one prompt another prompt's K/V: by induction along the chain, hits are exact.
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The prefix-cache key of a full block: its tokens and everything before them."""
    return hash((parent_hash, token_ids))


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found

    def record(self, num_queried: int, num_hit: int) -> None:
        self.queries += num_queried
        self.hits += num_hit


@dataclass
class BlockManager:
    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self):
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        # An insertion-ordered dict used as a queue with O(1) removal: blocks freed longest
        # ago are handed out first, so recently freed prefixes survive longest.
        self._free: dict[int, None] = dict.fromkeys(range(self.num_blocks))
        self._hash_to_block: dict[int, int] = {}

    # ---- usage -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (0.0 .. 1.0)."""
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, seq: CachedSequence, num_tokens: int) -> int:
        """Blocks to add so the sequence has slots for ``num_tokens`` tokens in total."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    # ---- allocation --------------------------------------------------------------------
    def allocate_prefix(self, seq: CachedSequence, lookup: bool = True) -> int:
        """Start a sequence's block table from the prefix cache; returns the tokens reused.

        Only blocks that end before the last token are looked up: that token must be
        computed this step to produce the next token's logits. Statistics are the caller's
        to record (``stats.record``), since only it knows whether the admission sticks.
        """
        assert not seq.block_table, "sequence already has blocks"
        seq.num_computed_tokens = 0
        if not (self.enable_prefix_caching and lookup):
            return 0
        tokens = seq.token_ids
        parent = None
        for i in range((len(tokens) - 1) // self.block_size):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            h = chain_hash(parent, chunk)
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if (block.parent_hash, block.token_ids) != (parent, chunk):
                break
            self._ref(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            parent = h
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        return seq.num_computed_tokens

    def can_append(self, seq: CachedSequence, num_new_tokens: int) -> bool:
        """Whether slots for ``num_new_tokens`` more computed tokens can be provided."""
        total = seq.num_computed_tokens + num_new_tokens
        return self.blocks_needed(seq, total) <= len(self._free)

    def append_slots(self, seq: CachedSequence, num_new_tokens: int) -> None:
        """Reserve slots for the next ``num_new_tokens`` tokens (new tokens, or lookahead
        slots for draft tokens that verification may later roll back)."""
        total = seq.num_computed_tokens + num_new_tokens
        needed = self.blocks_needed(seq, total)
        if needed > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {needed}, have {len(self._free)}")
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())

    def mark_computed(self, seq: CachedSequence, num_tokens: int) -> None:
        """The next ``num_tokens`` tokens' K/V now stand in the cache (in slots reserved by
        ``append_slots``). Reserved blocks past them (unused lookahead, rejected drafts) go
        back to the pool. The engine calls this once per sequence and step: it alone moves
        ``num_computed_tokens`` forward."""
        total = seq.num_computed_tokens + num_tokens
        if num_tokens < 0 or total > len(seq.block_table) * self.block_size:
            raise ValueError(
                f"cannot mark {num_tokens} more tokens computed: {seq.num_computed_tokens} are, "
                f"and the reserved blocks hold {len(seq.block_table) * self.block_size}"
            )
        seq.num_computed_tokens = total
        keep = -(-total // self.block_size)
        while len(seq.block_table) > keep:
            self._unref(seq.block_table.pop())

    def commit_full_blocks(self, seq: CachedSequence) -> None:
        """Hash the blocks that are now full of computed, accepted tokens so that later
        sequences can share them."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(len(seq.block_hashes), full):
            chunk = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = chain_hash(parent, chunk)
            block = self.blocks[seq.block_table[i]]
            if h not in self._hash_to_block:
                block.hash, block.parent_hash, block.token_ids = h, parent, chunk
                self._hash_to_block[h] = block.block_id
            seq.block_hashes.append(h)
            parent = h

    def free(self, seq: CachedSequence) -> None:
        """Release all of a sequence's blocks (finished, aborted or preempted)."""
        # Tail first, so a prefix's first blocks are the last to be handed out again.
        for block_id in reversed(seq.block_table):
            self._unref(block_id)
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_computed_tokens = 0

    # ---- internals ---------------------------------------------------------------------
    def _take_free_block(self) -> int:
        block_id = next(iter(self._free))
        del self._free[block_id]
        block = self.blocks[block_id]
        if block.hash is not None and self._hash_to_block.get(block.hash) == block_id:
            del self._hash_to_block[block.hash]  # evict the stale prefix entry
        block.hash, block.parent_hash, block.token_ids, block.ref_count = None, None, (), 1
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]  # revive a cached block from the free list
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            self._free[block_id] = None
