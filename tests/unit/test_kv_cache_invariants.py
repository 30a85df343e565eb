"""The block manager's invariants after any sequence of operations (seeded random walks): every block is either
referenced or free, never both; each block's reference count is the number of tables (requests' and parked
sessions') that hold it; the prefix-cache index and the blocks' hashes agree; a request's KV never loses a
block it still reads."""

import random
from collections import Counter

import pytest

from app.engine.kv_cache import DROPPED, BlockManager

NUM_BLOCKS, BLOCK_SIZE, VOCAB = 24, 4, 3  # a tiny vocabulary: prompts share prefixes often


def check_invariants(blocks: BlockManager) -> None:
    tables = [entry.table for entry in blocks._requests.values()] + [p.blocks.table for p in blocks._parked.values()]
    references = Counter(b for table in tables for b in table if b != DROPPED)
    for block in blocks._blocks:
        assert block.ref_count == references[block.block_id], block
        assert (block.ref_count == 0) == (block.block_id in blocks._free), block
    assert blocks.num_free_blocks + len(references) == blocks.num_blocks  # free + referenced = the pool
    for block_hash, block_id in blocks._cached.items():
        assert blocks._blocks[block_id].block_hash == block_hash
    assert all(b.block_hash is None or blocks._cached.get(b.block_hash) == b.block_id for b in blocks._blocks)
    assert 0 <= blocks.num_used_blocks <= blocks.num_blocks


class Walk:
    """Requests as the scheduler drives them: admitted (prefix lookup or session resume), grown a step at a time,
    their full blocks cached, drafts truncated, old blocks handed back, finished (freed or parked) or preempted."""

    def __init__(self, seed: int, window: int | None) -> None:
        self.rng, self.window = random.Random(seed), window
        self.blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE, max_parked=3)
        self.tokens: dict[str, list[int]] = {}  # request -> its tokens
        self.computed: dict[str, int] = {}  # request -> tokens whose KV it holds
        self.sessions: dict[str, str | None] = {}  # request -> the session it hands its KV on to
        self.next_id = 0

    def step(self) -> None:
        action = self.rng.choice(["admit", "admit", "grow", "grow", "grow", "grow", "finish", "preempt"])
        live = sorted(self.tokens)
        if action == "admit" or not live:
            return self.admit()
        request = self.rng.choice(live)
        getattr(self, action)(request)

    def admit(self) -> None:
        request, self.next_id = f"r{self.next_id}", self.next_id + 1
        tokens = [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(1, 14))]
        session = f"s{self.rng.randrange(4)}" if self.rng.random() < 0.4 else None
        resumed = self.blocks.resume(request, session, tokens) if session else None
        computed = resumed if resumed is not None else self.blocks.find_cached_prefix(request, tokens)
        assert computed < len(tokens)
        if not self.blocks.allocate(request, len(tokens)):
            self.blocks.free(request)  # the scheduler leaves it waiting, holding nothing
            return
        self.tokens[request], self.computed[request], self.sessions[request] = tokens, computed, session
        self.compute(request, len(tokens))

    def compute(self, request: str, upto: int) -> None:
        self.computed[request] = upto
        self.blocks.cache_full_blocks(request, self.tokens[request], upto)
        if self.window:
            self.blocks.release_before(request, upto - self.window + 1)

    def grow(self, request: str) -> None:
        """One decode step with ``k`` drafts, of which the target keeps ``accepted``: the rejected drafts' blocks
        go back (as Scheduler.update does)."""
        k = self.rng.randint(0, 4)
        if not self.blocks.allocate(request, len(self.tokens[request]) + 1 + k):
            return self.preempt(request)
        accepted = self.rng.randint(0, k)
        self.tokens[request] += [self.rng.randrange(VOCAB) for _ in range(1 + accepted)]
        self.compute(request, len(self.tokens[request]))
        if accepted < k:
            self.blocks.truncate(request, len(self.tokens[request]) + 1)  # + the token sampled now

    def finish(self, request: str) -> None:
        session = self.sessions.pop(request)
        if session and self.rng.random() < 0.7:
            self.blocks.park(request, session, self.tokens[request][: self.computed[request]])
        else:
            self.blocks.free(request)
        del self.tokens[request], self.computed[request]

    def preempt(self, request: str) -> None:
        self.blocks.free(request)
        del self.tokens[request], self.computed[request], self.sessions[request]


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("seed", range(12))
def test_invariants_hold_after_any_sequence_of_operations(seed, window):
    walk = Walk(seed, window)
    for _ in range(400):
        walk.step()
        check_invariants(walk.blocks)
        for request, tokens in walk.tokens.items():  # every block a request still reads is its own and live
            table = walk.blocks.block_table(request)
            first_read = 0 if window is None else max(0, walk.computed[request] - window + 1) // BLOCK_SIZE
            assert len(table) >= walk.blocks.blocks_needed(len(tokens))
            assert all(b != DROPPED for b in table[first_read:]), (request, table)
    for request in list(walk.tokens):
        walk.finish(request)
    for session in range(4):
        walk.blocks.drop_session(f"s{session}")
    check_invariants(walk.blocks)
    assert walk.blocks.num_free_blocks == NUM_BLOCKS  # everything comes back
