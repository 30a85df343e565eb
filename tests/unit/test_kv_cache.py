"""Block manager without a model: allocation, freeing, prefix caching and LRU eviction."""

import pytest

from app.engine.kv_cache import BlockManager


def test_allocate_grows_tables_and_free_returns_every_block():
    blocks = BlockManager(num_blocks=8, block_size=4)
    assert blocks.allocate("a", 5) and blocks.block_table("a") == [0, 1]
    assert blocks.allocate("a", 8) and len(blocks.block_table("a")) == 2  # still fits
    assert blocks.allocate("b", 9) and len(blocks.block_table("b")) == 3
    assert blocks.num_used_blocks == 5
    blocks.free("a")
    blocks.free("b")
    assert blocks.num_free_blocks == 8


def test_allocation_that_does_not_fit_changes_nothing():
    blocks = BlockManager(num_blocks=3, block_size=4)
    assert blocks.allocate("a", 8)
    assert not blocks.allocate("b", 8)
    assert blocks.num_free_blocks == 1 and blocks.block_table("b") == []


def test_cached_prefix_is_found_after_its_owner_finishes():
    blocks = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    blocks.allocate("a", 10)
    blocks.cache_full_blocks("a", tokens, num_computed_tokens=10)  # two full blocks, one partial
    table_a = list(blocks.block_table("a"))
    blocks.free("a")
    assert blocks.find_cached_prefix("b", tokens[:9] + [99, 98]) == 8
    assert blocks.block_table("b") == table_a[:2]


def test_last_token_is_never_served_from_cache():
    blocks = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(8))
    blocks.allocate("a", 8)
    blocks.cache_full_blocks("a", tokens, 8)
    blocks.free("a")
    # The whole prompt is cached, but its last token must run to produce logits: only one block is reused.
    assert blocks.find_cached_prefix("b", tokens) == 4


def test_a_block_matches_only_after_the_same_prefix():
    blocks = BlockManager(num_blocks=8, block_size=2)
    blocks.allocate("a", 4)
    blocks.cache_full_blocks("a", [1, 2, 3, 4], 4)
    blocks.free("a")
    # Block [3, 4] is cached, but after [1, 2]; behind [5, 6] it is a different prefix.
    assert blocks.find_cached_prefix("b", [5, 6, 3, 4, 7]) == 0


def test_shared_block_stays_until_its_last_user_frees_it():
    blocks = BlockManager(num_blocks=4, block_size=2)
    blocks.allocate("a", 3)
    blocks.cache_full_blocks("a", [1, 2, 3], 3)
    assert blocks.find_cached_prefix("b", [1, 2, 9]) == 2
    blocks.allocate("b", 3)
    shared = blocks.block_table("a")[0]
    assert blocks.block_table("b")[0] == shared
    blocks.free("a")
    assert shared not in blocks._free  # still used by b
    blocks.free("b")
    assert blocks.num_free_blocks == 4


def test_least_recently_used_cached_block_is_evicted_first():
    blocks = BlockManager(num_blocks=3, block_size=2)
    for rid, tokens in (("old", [1, 2]), ("new", [3, 4])):
        blocks.allocate(rid, 3)
        blocks.cache_full_blocks(rid, tokens + [0], 2)
        blocks.free(rid)
    # The free queue is in release order, so "old"'s cached block is the first one handed out again.
    blocks.allocate("x", 2)
    blocks.allocate("y", 2)
    assert blocks.find_cached_prefix("q1", [1, 2, 5]) == 0  # "old" was evicted
    assert blocks.find_cached_prefix("q2", [3, 4, 5]) == 2  # "new" survived


def test_prefix_caching_can_be_disabled():
    blocks = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    blocks.allocate("a", 3)
    blocks.cache_full_blocks("a", [1, 2, 3], 3)
    blocks.free("a")
    assert blocks.find_cached_prefix("b", [1, 2, 3]) == 0


def test_pool_must_have_a_block():
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(num_blocks=0, block_size=16)

