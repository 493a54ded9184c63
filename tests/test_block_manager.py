"""Block accounting of the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from engine.kv_cache import BlockManager


@dataclass
class Seq:
    token_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


def compute(bm: BlockManager, seq: Seq, n: int) -> None:
    """What the engine does for a step of ``n`` tokens: reserve, compute, commit."""
    bm.append_slots(seq, n)
    bm.mark_computed(seq, n)
    bm.commit_full_blocks(seq)


def test_append_slots_allocates_whole_blocks_and_free_returns_them():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Seq(list(range(10)))
    bm.allocate_prefix(seq)
    compute(bm, seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    bm.append_slots(seq, 2)  # still fits in the third block
    assert len(seq.block_table) == 3
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == [] and bm.usage == 0


def test_lookahead_slots_past_the_accepted_drafts_are_released():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Seq(list(range(6)))
    bm.allocate_prefix(seq)
    compute(bm, seq, 6)
    bm.append_slots(seq, 7)  # the decode token and 6 drafts: positions 6..12 -> 4 blocks
    assert len(seq.block_table) == 4
    bm.mark_computed(seq, 2)  # the decode token and one accepted draft
    assert seq.num_computed_tokens == 8 and len(seq.block_table) == 2
    assert bm.num_free_blocks == 6
    with pytest.raises(ValueError, match="reserved blocks hold 8"):
        bm.mark_computed(seq, 1)  # no slot was reserved for it


def test_computed_tokens_never_move_back_into_shared_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Seq(list(range(9)))
    bm.allocate_prefix(a)
    compute(bm, a, 9)
    b = Seq(list(range(8)) + [50, 51])
    assert bm.allocate_prefix(b) == 8  # b now shares a's first two blocks
    with pytest.raises(ValueError, match="cannot mark -7"):
        bm.mark_computed(a, -7)  # would make a write into a block b reads
    assert a.num_computed_tokens == 9 and [bm.blocks[i].ref_count for i in b.block_table] == [2, 2]


def test_a_colliding_hash_is_not_a_hit():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Seq([1, 2, 3, 4, 5])
    bm.allocate_prefix(a)
    compute(bm, a, 5)
    # Forge a collision: the cache entry claims a different parent than the lookup has.
    bm.blocks[a.block_table[0]].parent_hash = 12345
    assert bm.allocate_prefix(Seq([1, 2, 3, 4, 5])) == 0


def test_cannot_append_beyond_the_pool():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = Seq(list(range(8)))
    bm.allocate_prefix(seq)
    assert bm.can_append(seq, 8) and not bm.can_append(seq, 9)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.append_slots(seq, 9)


def test_prefix_blocks_are_shared_and_ref_counted():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = Seq(list(range(12)))
    bm.allocate_prefix(a)
    compute(bm, a, 12)
    b = Seq(list(range(8)) + [99, 98, 97])
    hit = bm.allocate_prefix(b)
    assert hit == 8 and b.block_table == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    compute(bm, b, 3)
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 10
    # Freed but still cached: a third sequence revives the blocks.
    c = Seq(list(range(12)) + [5])
    assert bm.allocate_prefix(c) == 12


def test_last_token_is_never_a_prefix_hit():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = Seq(list(range(8)))
    bm.allocate_prefix(a)
    compute(bm, a, 8)
    same = Seq(list(range(8)))
    # Both blocks are cached, but the last token must be computed to get logits.
    assert bm.allocate_prefix(same) == 4


def test_hash_chain_depends_on_the_whole_prefix():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = Seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate_prefix(a)
    compute(bm, a, 9)
    # Same second block, different first block: no hit at all.
    b = Seq([0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.allocate_prefix(b) == 0


def test_reused_free_block_loses_its_stale_hash():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = Seq([1, 2, 3, 4, 5])
    bm.allocate_prefix(a)
    compute(bm, a, 5)
    bm.free(a)
    other = Seq(list(range(20, 28)))
    bm.allocate_prefix(other)
    compute(bm, other, 8)  # takes both blocks, evicting a's cached prefix
    bm.free(other)
    assert bm.allocate_prefix(Seq([1, 2, 3, 4, 5])) == 0


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    a = Seq(list(range(12)))
    bm.allocate_prefix(a)
    compute(bm, a, 12)
    assert bm.allocate_prefix(Seq(list(range(12)))) == 0
