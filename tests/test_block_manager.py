"""The native engine's paged KV-cache blocks: refcounted sharing of full blocks by their token
prefix, and eviction of freed cached blocks, least recently freed first."""

from worker.engines.native.block_manager import BlockManager, BlockTable


def test_block_manager_shares_refcounts_and_evicts_least_recently_freed():
    blocks = BlockManager(num_blocks=6, block_size=4)
    tokens = list(range(10))  # two full blocks and a partial one
    first = BlockTable()
    blocks.grow(first, len(tokens))
    blocks.commit(first, tokens, len(tokens))
    assert len(first.hashes) == 2

    second = BlockTable()
    assert blocks.match_prefix(second, tokens + [99]) == (8, 8)
    assert second.blocks == first.blocks[:2]
    assert blocks.num_free == 3  # shared blocks are held once
    # A different second block shares only the first.
    other = BlockTable()
    assert blocks.match_prefix(other, tokens[:4] + [7, 7, 7, 7, 1]) == (4, 8)

    for table in (first, second, other):
        blocks.release(table)
    assert blocks.num_free == 6
    # Freed but cached: a new lookup still finds them.
    again = BlockTable()
    assert blocks.match_prefix(again, tokens) == (8, 8)
    blocks.release(again)
    # Taking every free block evicts the cached ones; after that nothing matches.
    hog = BlockTable()
    blocks.grow(hog, 6 * 4)
    blocks.release(hog)
    assert blocks.match_prefix(BlockTable(), tokens) == (0, 8)


def test_block_manager_evicts_a_shared_prefix_last():
    blocks = BlockManager(num_blocks=4, block_size=2)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    table = BlockTable()
    blocks.grow(table, len(tokens))
    blocks.commit(table, tokens, len(tokens))
    blocks.release(table)
    # Two new blocks take the least recently freed: the partial tail, then the last full block;
    # the head of the prefix stays cached.
    one = BlockTable()
    blocks.grow(one, 4)
    assert blocks.match_prefix(BlockTable(), tokens)[0] == 4
    blocks.release(one)


def test_block_manager_without_prefix_caching_shares_nothing():
    blocks = BlockManager(num_blocks=4, block_size=2, prefix_caching=False)
    table = BlockTable()
    blocks.grow(table, 5)
    blocks.commit(table, [1, 2, 3, 4, 5], 5)
    assert blocks.match_prefix(BlockTable(), [1, 2, 3, 4, 5]) == (0, 0)


def test_a_block_is_named_at_the_step_that_fills_it():
    """As decode steps commit, one computed token more each: a block is named (shareable) at the
    step that computes its last token, neither before nor a step late."""
    blocks = BlockManager(num_blocks=4, block_size=4)
    tokens = list(range(12))
    table = BlockTable()
    blocks.grow(table, len(tokens))
    for computed in range(1, len(tokens) + 1):
        blocks.commit(table, tokens, computed)
        assert len(table.hashes) == computed // 4
        assert blocks.match_prefix(BlockTable(), tokens[:computed] + [99])[0] == computed // 4 * 4
