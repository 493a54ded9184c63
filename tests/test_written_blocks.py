"""WrittenBlocks: a drafter trusts a block's entries only for the content it computed them
for, and not after it wrote into that block again (engine/decoders/written_blocks.py)."""

from __future__ import annotations

from engine.decoders.written_blocks import WrittenBlocks, blocks_within, past_fresh_blocks
from engine.sequence import CacheState


def cache(table: list[int], hashes: list[int], num_cached: int = 16) -> CacheState:
    return CacheState(num_cached=num_cached, block_table=table, epoch=0, block_hashes=hashes)


def test_blocks_wholly_inside_a_written_range_are_trusted_for_their_content_only():
    written = WrittenBlocks(block_size=4)
    filled = cache([7, 3, 9, 5], [70, 30, 90])  # three committed blocks, the last is open
    # Positions 1..13 written: block 0 (0..3) is not wholly inside, nor the uncommitted block 3.
    assert written.record(filled, 1, 14) == 12
    assert len(written) == 2
    assert written.trusted_prefix(filled) == 0  # block 0 was never recorded
    assert written.record(filled, 0, 12) == 12
    assert written.trusted_prefix(filled) == 12
    # Another sequence holding block 3 with other content: trusted up to there only.
    assert written.trusted_prefix(cache([7, 3, 9], [70, 31, 90])) == 4
    assert written.trusted_prefix(cache([8, 3, 9], [70, 30, 90])) == 0


def test_writing_into_a_block_forgets_it_until_recorded_again():
    written = WrittenBlocks(block_size=4)
    filled = cache([7, 3, 9], [70, 30, 90])
    written.record(filled, 0, 12)
    written.overwrite([2, 3], 5, 2)  # positions 5..6 of another table: its block 1 is id 3
    assert written.trusted_prefix(filled) == 4
    written.overwrite([7], 0, 100)  # ranges past the table stop at its end
    assert written.trusted_prefix(filled) == 0
    assert len(written) == 1  # block 9 stands


def test_a_reader_from_zeros_skips_only_leading_whole_blocks_written_fresh_this_pass():
    table = [7, 3, 9, 5]
    fresh = blocks_within(table, 1, 14, 4)  # positions 1..13: blocks 1 and 2 whole
    assert fresh == {3, 9}
    assert past_fresh_blocks(table, 4, 16, 4, fresh) == 12
    assert past_fresh_blocks(table, 4, 10, 4, fresh) == 8  # never past the hit's end
    assert past_fresh_blocks(table, 0, 16, 4, fresh) == 0  # block 0 is not fresh
    assert past_fresh_blocks(table, 5, 16, 4, fresh) == 5  # mid-block: left as it is
