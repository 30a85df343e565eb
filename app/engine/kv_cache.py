"""The KV block manager: a fixed pool of blocks, block tables, and automatic prefix caching.

Pure bookkeeping (no tensors): block ``i`` owns pool slots ``[i*block_size, (i+1)*block_size)`` of
every layer's KV tensors, which the runner allocates once at start.

Prefix caching (as in vLLM): once a block is full of computed tokens it is registered under a hash
of its tokens and of every token before it. A new request whose prompt starts with the same tokens
reuses those blocks instead of recomputing them. A block whose last user finishes stays cached, on
a free queue in least-recently-used order; it is evicted (its hash dropped) only when the pool needs
a fresh block. Invariant: every block is either referenced (by a request or a parked session,
ref_count > 0) or on the free queue, never both.

Sessions: a finished request that names a session (a draft model's calls for one target sequence) can
leave its blocks parked under it (``park``): the session's next request takes them back (``resume``),
keeps the KV of the tokens it shares with the last one, partial last block included, and rolls the rest
back (frees those blocks). The prefix cache alone would keep only full blocks. Parked blocks are
reclaimable: the pool takes them back, oldest session first, before it reports a shortage.

Sliding windows: where every attention layer sees only its last ``window`` keys, a request's blocks wholly
before its window are handed back as it grows (``release_before``); its table keeps their places as
``DROPPED``, so block ``i`` still holds tokens ``[i*block_size, (i+1)*block_size)``.
"""

from __future__ import annotations

import collections
import hashlib
from array import array
from dataclasses import dataclass, field


DROPPED = -1  # a block-table entry whose block was handed back (wholly before a sliding window)


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set while the block holds a registered full prefix block


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0


@dataclass
class _RequestBlocks:
    table: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # hashes of its full blocks, in order
    num_dropped: int = 0  # its leading table entries handed back (release_before): DROPPED


@dataclass
class _Parked:
    blocks: _RequestBlocks
    token_ids: list[int]  # the tokens whose KV the blocks hold, in order


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, max_parked: int = 64) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.max_parked = max_parked
        self._parked: collections.OrderedDict[str, _Parked] = collections.OrderedDict()  # oldest first
        self._blocks = [_Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (least recently used first); dict for O(1) removal on a cache hit.
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self._requests: dict[str, _RequestBlocks] = {}
        self.prefix_stats = PrefixCacheStats()

    # ---- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks that requests hold (parked sessions' own blocks are reclaimable, like cached free ones)."""
        return self.num_blocks - len(self._free) - self.num_parked_blocks

    @property
    def num_parked_blocks(self) -> int:
        """Blocks held by parked sessions only (a shared prefix may be parked by several: each reference is theirs)."""
        parked = collections.Counter(b for p in self._parked.values() for b in p.blocks.table if b != DROPPED)
        return sum(1 for block, references in parked.items() if self._blocks[block].ref_count == references)

    def block_table(self, request_id: str) -> list[int]:
        return self._requests[request_id].table

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ----------------------------------------------------------------------
    def find_cached_prefix(self, request_id: str, token_ids: list[int], salt: str | None = None) -> int:
        """Attach the longest cached prefix of ``token_ids`` to a request that holds no blocks yet.

        Returns how many tokens it covers (a multiple of block_size). At least one token is always
        left to compute, because the last one must run through the model to produce logits.
        """
        entry = self._requests.setdefault(request_id, _RequestBlocks())
        if entry.table or not self.enable_prefix_caching:
            return 0
        for block_hash in self._prefix_hashes(token_ids, 0, (len(token_ids) - 1) // self.block_size, salt=salt):
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            self._take(block_id)
            entry.table.append(block_id)
            entry.hashes.append(block_hash)
        return len(entry.table) * self.block_size

    def first_uncached_block(self, token_ids: list[int], salt: str | None = None) -> bytes | None:
        """The prefix hash of the first block of ``token_ids`` that ``find_cached_prefix`` would not find, or None."""
        if not self.enable_prefix_caching:
            return None
        hashes = self._prefix_hashes(token_ids, 0, (len(token_ids) - 1) // self.block_size, salt=salt)
        return next((block_hash for block_hash in hashes if block_hash not in self._cached), None)

    def blocks_filled(self, request_id: str, token_ids: list[int], num_computed_tokens: int,
                      salt: str | None = None) -> list[bytes]:
        """The prefix hashes of the request's blocks that become full once ``num_computed_tokens`` are computed:
        those a step computing up to there registers in the cache (``cache_full_blocks``)."""
        if not self.enable_prefix_caching:
            return []
        entry = self._requests.get(request_id) or _RequestBlocks()
        return list(self._prefix_hashes(token_ids, len(entry.hashes), num_computed_tokens // self.block_size, entry.hashes,
                                        salt))

    def _prefix_hashes(self, token_ids: list[int], start: int, end: int, known: list[bytes] = (), salt: str | None = None):
        """The prefix hashes of blocks ``start`` to ``end`` (exclusive) of ``token_ids``, chained from ``known``,
        the hashes of the blocks before ``start``, or from the salt's root (vLLM's cache_salt: a request shares
        cached blocks only with requests of the same salt)."""
        parent = known[start - 1] if start else _root(salt)
        for index in range(start, end):
            parent = _hash_block(parent, token_ids[index * self.block_size : (index + 1) * self.block_size])
            yield parent

    def record_prefix_query(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (a lookup retried after a failed admission counts once)."""
        self.prefix_stats.queried_tokens += num_queried_tokens
        self.prefix_stats.hit_tokens += num_hit_tokens

    def cache_full_blocks(self, request_id: str, token_ids: list[int], num_computed_tokens: int,
                          salt: str | None = None) -> None:
        """Register the request's blocks that are now full of computed tokens under their prefix hash."""
        if not self.enable_prefix_caching:
            return
        entry = self._requests[request_id]
        num_full = min(num_computed_tokens // self.block_size, len(entry.table))
        for index, block_hash in enumerate(self._prefix_hashes(token_ids, len(entry.hashes), num_full, entry.hashes, salt),
                                           start=len(entry.hashes)):
            entry.hashes.append(block_hash)
            if entry.table[index] == DROPPED:
                continue
            block = self._blocks[entry.table[index]]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block.block_id

    # ---- allocation ------------------------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's block table to hold ``num_tokens`` tokens; False (and no change) if the pool is short."""
        entry = self._requests.setdefault(request_id, _RequestBlocks())
        missing = self.blocks_needed(num_tokens) - len(entry.table)
        if missing <= 0:
            return True
        if missing > len(self._free) and missing > len(self._free) + self.num_parked_blocks:
            return False  # short even with every parked session dropped: keep them (a retry comes each step)
        while missing > len(self._free) and self._parked:
            self._drop_oldest_session()
        if missing > len(self._free):
            return False
        for _ in range(missing):
            block_id, _ = self._free.popitem(last=False)  # least recently used
            self._evict(block_id)
            self._blocks[block_id].ref_count = 1
            entry.table.append(block_id)
        return True

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Keep only the blocks holding the request's first ``num_tokens`` tokens (rejected drafts give theirs back)."""
        entry = self._requests.get(request_id)
        if entry is None:
            return
        keep = max(self.blocks_needed(num_tokens), len(entry.hashes))  # a cached (full, computed) block stays
        while len(entry.table) > keep:
            self._release(entry.table.pop())

    def release_before(self, request_id: str, num_tokens: int) -> None:
        """Hand back the request's blocks that hold only tokens before ``num_tokens`` (no query will see them again:
        they left every layer's window); a cached one stays reusable until evicted."""
        entry = self._requests.get(request_id)
        if entry is None:
            return
        while entry.num_dropped < min(num_tokens // self.block_size, len(entry.table)):  # from the last one on
            self._release(entry.table[entry.num_dropped])
            entry.table[entry.num_dropped] = DROPPED
            entry.num_dropped += 1

    def free(self, request_id: str) -> None:
        """Release a request's blocks; cached ones stay reusable until evicted."""
        entry = self._requests.pop(request_id, None)
        if entry is not None:
            self._release_all(entry)

    # ---- sessions ----------------------------------------------------------------------------
    def park(self, request_id: str, session_id: str, token_ids: list[int]) -> None:
        """Keep a finished request's blocks, holding the KV of ``token_ids``, for ``session_id``'s next request."""
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        while len(entry.table) > self.blocks_needed(len(token_ids)):
            self._release(entry.table.pop())
        self.drop_session(session_id)  # a newer request of the session replaces an older one
        self._parked[session_id] = _Parked(entry, list(token_ids))
        while len(self._parked) > self.max_parked:
            self._drop_oldest_session()

    def resume(self, request_id: str, session_id: str, token_ids: list[int]) -> int | None:
        """Give a request that holds no blocks yet its session's parked blocks, rolled back to the tokens it shares
        with them; returns how many tokens' KV it has (at least its last token is left to compute), or None when
        the session has nothing parked."""
        parked = self._parked.pop(session_id, None)
        if parked is None:
            return None
        if self._requests.get(request_id, _RequestBlocks()).table:
            self._release_all(parked.blocks)
            return None
        common = min(_common_prefix_length(parked.token_ids, token_ids), len(token_ids) - 1)
        entry, full = parked.blocks, common // self.block_size
        if DROPPED in entry.table:  # a rollback may reach back past the window: recompute instead
            self._release_all(entry)
            return None
        keep, computed = full, full * self.block_size
        if common % self.block_size and full < len(entry.table) and self._blocks[entry.table[full]].ref_count == 1:
            # The block the two part in is the session's own: keep its first rows, which the request overwrites past
            # ``common``. If it was full and registered, its hash no longer describes it.
            self._evict(entry.table[full])
            keep, computed = full + 1, common
        while len(entry.table) > keep:
            self._release(entry.table.pop())
        del entry.hashes[full:]
        self._requests[request_id] = entry
        return computed

    def drop_session(self, session_id: str) -> None:
        parked = self._parked.pop(session_id, None)
        if parked is not None:
            self._release_all(parked.blocks)

    def _drop_oldest_session(self) -> None:
        self._release_all(self._parked.popitem(last=False)[1].blocks)

    def _release_all(self, entry: _RequestBlocks) -> None:
        # Tail blocks go on the queue first, so they are evicted before the prefix blocks shared more widely.
        for block_id in reversed(entry.table):
            self._release(block_id)

    def _release(self, block_id: int) -> None:
        if block_id == DROPPED:
            return
        block = self._blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None

    def _take(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _evict(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _root(salt: str | None) -> bytes:
    """The hash chain's start: none for unsalted requests, else one only the same salt gives."""
    return b"" if salt is None else hashlib.sha256(b"cache_salt\0" + salt.encode("utf-8", "surrogatepass")).digest()


def _hash_block(parent_hash: bytes, token_ids: list[int]) -> bytes:
    """A collision-resistant hash of a full block and, through the parent hash, of all tokens before it."""
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()
