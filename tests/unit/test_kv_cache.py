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


def test_a_salted_prefix_is_shared_only_with_requests_of_the_same_salt():
    """vLLM's cache_salt: a tenant's requests hit its own cached prompts, never another tenant's nor unsalted ones."""
    blocks = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(10))
    blocks.allocate("a", 10)
    blocks.cache_full_blocks("a", tokens, num_computed_tokens=10, salt="tenant-1")
    blocks.free("a")
    assert blocks.find_cached_prefix("other tenant", tokens, salt="tenant-2") == 0
    assert blocks.find_cached_prefix("unsalted", tokens) == 0
    assert blocks.first_uncached_block(tokens, salt="tenant-1") is None
    assert blocks.first_uncached_block(tokens, salt="tenant-2") is not None
    assert blocks.find_cached_prefix("same tenant", tokens, salt="tenant-1") == 8
    assert blocks.blocks_filled("b", tokens, 8, salt="tenant-1") == blocks.blocks_filled("c", tokens, 8, salt="tenant-1")
    assert blocks.blocks_filled("b", tokens, 8, salt="tenant-1") != blocks.blocks_filled("b", tokens, 8)


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



# ---- sessions: a finished request's KV handed to its session's next request --------------------
def _finished(blocks: BlockManager, request_id: str, tokens: list[int], session: str = "s") -> list[int]:
    """A request that computed ``tokens`` and finished, its blocks parked under ``session``; its block table."""
    assert blocks.allocate(request_id, len(tokens))
    blocks.cache_full_blocks(request_id, tokens, num_computed_tokens=len(tokens))
    table = list(blocks.block_table(request_id))
    blocks.park(request_id, session, tokens)
    return table


def test_the_next_request_of_a_session_keeps_all_it_shares_partial_block_included():
    blocks = BlockManager(num_blocks=8, block_size=4)
    table = _finished(blocks, "call-1", list(range(10)))  # blocks of 4 + 4 + 2
    assert blocks.num_used_blocks == 0 and blocks.num_parked_blocks == 3
    assert blocks.resume("call-2", "s", list(range(10)) + [50, 51]) == 10  # the tokens after 10 are new
    assert blocks.block_table("call-2") == table and blocks.num_parked_blocks == 0


def test_what_the_next_request_does_not_share_is_rolled_back():
    blocks = BlockManager(num_blocks=8, block_size=4)
    table = _finished(blocks, "call-1", list(range(10)))
    assert blocks.resume("call-2", "s", [0, 1, 2, 3, 4, 5, 99, 98]) == 6  # parts at 6, inside the second block
    assert blocks.block_table("call-2") == table[:2] and blocks.num_free_blocks == 6
    # the second block was full and registered: its hash no longer describes it, so nobody else finds it
    assert blocks.find_cached_prefix("other", list(range(10))) == 4


def test_a_block_others_share_is_not_rolled_back_into_but_recomputed():
    blocks = BlockManager(num_blocks=8, block_size=4)
    table = _finished(blocks, "call-1", list(range(10)))
    assert blocks.find_cached_prefix("other", list(range(9))) == 8  # another request holds both full blocks
    assert blocks.resume("call-2", "s", [0, 1, 2, 3, 4, 5, 99]) == 4
    assert blocks.block_table("call-2") == table[:1]


def test_at_least_the_last_token_is_left_to_compute_and_an_unknown_session_has_nothing():
    blocks = BlockManager(num_blocks=8, block_size=4)
    _finished(blocks, "call-1", list(range(8)))
    assert blocks.resume("call-2", "nobody", list(range(8))) is None
    assert blocks.resume("call-2", "s", list(range(8))) == 7


def test_parked_sessions_give_their_blocks_back_when_the_pool_needs_them_oldest_first():
    blocks = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    _finished(blocks, "a", list(range(8)), session="old")
    _finished(blocks, "b", list(range(8)), session="new")
    assert blocks.num_free_blocks == 0 and blocks.num_used_blocks == 0
    assert blocks.allocate("c", 5)  # two blocks: the older session's
    assert blocks.resume("d", "old", list(range(9))) is None and blocks.resume("d", "new", list(range(9))) == 8


def test_an_allocation_too_large_even_without_the_sessions_keeps_them():
    """A waiting request that cannot fit is retried each step: it must not wipe the parked sessions for nothing."""
    blocks = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    _finished(blocks, "a", list(range(8)), session="s1")
    _finished(blocks, "b", list(range(8)), session="s2")
    assert blocks.allocate("running", 12) and blocks.num_free_blocks == 1  # 1 free + 4 parked: 5 blocks at most
    assert not blocks.allocate("big", 24)  # 6 blocks
    assert blocks.num_parked_blocks == 4 and blocks.resume("next", "s1", list(range(9))) == 8


def test_at_most_max_parked_sessions_are_kept():
    blocks = BlockManager(num_blocks=16, block_size=4, max_parked=2)
    for session in ("s1", "s2", "s3"):
        _finished(blocks, f"r-{session}", list(range(5)), session=session)
    assert blocks.resume("x", "s1", list(range(6))) is None
    assert blocks.resume("y", "s3", list(range(6))) == 5


def test_a_prefix_two_parked_sessions_share_counts_as_parked_not_as_used():
    blocks = BlockManager(num_blocks=8, block_size=4)
    _finished(blocks, "a", list(range(9)), session="s1")  # blocks of 4 + 4 + 1
    assert blocks.find_cached_prefix("b", list(range(9))) == 8  # the second session starts from the first's two full blocks
    assert blocks.allocate("b", 9)
    blocks.park("b", "s2", list(range(9)))
    # nothing runs: the two shared blocks and each session's partial one are all reclaimable, none is in use
    assert (blocks.num_used_blocks, blocks.num_parked_blocks, blocks.num_free_blocks) == (0, 4, 4)
