"""Block allocator: physical block ids, reference counts, the free list and the prefix-hash map.

It knows nothing of requests or tensors. Every operation is O(1) (amortised) in the pool size.
A block is in exactly one of three states:

- used: ref count > 0 (named by at least one block table);
- cached: ref count 0 but registered under a prefix hash, so a later prompt can reuse it;
  it waits in the evictable queue, which is LRU-ordered (oldest released first out);
- free: ref count 0, no hash; it waits in the clean queue.

The free list is the two queues together: `allocate` takes a clean block first and only evicts
the least recently released cached block when no clean one is left. (vLLM v1 keeps a single
queue; with two, a cached prefix is never sacrificed while empty blocks exist, at the same O(1).)
Callers release a sequence's blocks tail-first so its tail is evicted before its prefix.

Error tiers: a shortage returns None (the caller must handle it); misuse (double free, unknown
block, incref of a free block) raises ValueError; `check_integrity` fails loudly on a broken
invariant.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque

import numpy as np

from protocol.prefix_hash import ROOT_HASH, hash_block  # noqa: F401  (kvcache's public names)


class IntegrityError(RuntimeError):
    """A broken allocator invariant: a bug, never an expected outcome."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise IntegrityError(msg)


class BlockAllocator:
    """Hands out block ids 0..num_blocks-1 with ref counts and a prefix-hash cache."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._clean: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks, LRU first
        self._hash_of: dict[int, int] = {}  # block -> prefix hash
        self._block_of: dict[int, int] = {}  # prefix hash -> block
        self.evictions = 0

    # ---- counts -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks with no content (clean)."""
        return len(self._clean)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks kept for prefix reuse; evicted on demand."""
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """Blocks `allocate` can hand out: clean plus evictable."""
        return len(self._clean) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    def ref_count(self, block: int) -> int:
        return self._ref[self._check_id(block)]

    def hash_of(self, block: int) -> int | None:
        return self._hash_of.get(self._check_id(block))

    # ---- allocate / free ----------------------------------------------------------------
    def allocate(self) -> int | None:
        """One block with ref count 1, or None when every block is in use."""
        if self._clean:
            block = self._clean.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
            self.evictions += 1
        else:
            return None
        self._ref[block] = 1
        return block

    def allocate_many(self, n: int) -> list[int] | None:
        """n blocks, all or nothing: None (and no change) when fewer than n are available."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_available:
            return None
        return [self.allocate() for _ in range(n)]  # type: ignore[misc]

    def incref(self, block: int) -> None:
        """Add a reference to a block already in use (fork, sharing)."""
        block = self._check_id(block)
        if self._ref[block] == 0:
            raise ValueError(f"incref of block {block}, which is not in use")
        self._ref[block] += 1

    def free(self, block: int, uncache: bool = False) -> None:
        """Drop one reference; at zero the block joins the cached or the clean queue.

        uncache: at zero, forget the block's prefix hash and make it clean (KV nobody vouches
        for, e.g. an import no reservation asked for, must never be served from the cache).
        """
        block = self._check_id(block)
        if self._ref[block] == 0:
            raise ValueError(f"double free of block {block}: its ref count is already 0")
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if block in self._hash_of and uncache:
                del self._block_of[self._hash_of.pop(block)]
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._clean.append(block)

    def free_many(self, blocks: list[int], uncache: bool = False) -> None:
        """Free in the order given (pass a table reversed to release its tail first).

        Validated first: a list that would double free raises ValueError and frees nothing.
        """
        ids = [self._check_id(b) for b in blocks]
        for b, n in Counter(ids).items():
            if n > self._ref[b]:
                raise ValueError(f"double free of block {b}: freed {n} times, ref count {self._ref[b]}")
        for b in ids:
            self.free(b, uncache)

    # ---- prefix cache -------------------------------------------------------------------
    def register(self, block: int, block_hash: int) -> bool:
        """Record that a used, full block holds the prefix `block_hash`.

        Returns False (and changes nothing) when another block already holds that hash or this
        block already has one: the first copy stays canonical.
        """
        block = self._check_id(block)
        if self._ref[block] == 0:
            raise ValueError(f"cannot register hash for block {block}, which is not in use")
        if block_hash in self._block_of or block in self._hash_of:
            return False
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        return True

    def lookup(self, block_hash: int) -> int | None:
        """The block holding this prefix hash, without taking a reference."""
        return self._block_of.get(block_hash)

    def acquire_cached(self, block_hash: int) -> int | None:
        """Take a reference to the block holding `block_hash` (reviving it if cached)."""
        block = self._block_of.get(block_hash)
        if block is None:
            return None
        if self._ref[block] == 0:
            del self._evictable[block]
        self._ref[block] += 1
        return block

    def evict_cached(self, n: int | None = None) -> int:
        """Drop up to n (all when None) cached blocks, oldest first; returns how many."""
        count = 0
        while self._evictable and (n is None or count < n):
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
            self._clean.append(block)
            self.evictions += 1
            count += 1
        return count

    def cached_hashes(self) -> set[int]:
        """Every prefix hash this pool holds (used or cached)."""
        return set(self._block_of)

    # ---- invariants ---------------------------------------------------------------------
    def _check_id(self, block: int) -> int:
        """The id as a plain int (numpy ints would leak into tables and break msgpack); bools,
        floats and out-of-range ids raise ValueError."""
        if isinstance(block, bool) or not isinstance(block, (int, np.integer)) \
                or not 0 <= block < self.num_blocks:
            raise ValueError(f"unknown block id {block!r} (pool has {self.num_blocks} blocks)")
        return int(block)

    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Fail loudly if any invariant is broken.

        expected_refs: block -> number of tables naming it; when given, every used block must
        have exactly that ref count and every block not named must have ref count 0.
        """
        clean, evict = set(self._clean), set(self._evictable)
        used = {b for b in range(self.num_blocks) if self._ref[b] > 0}
        _require(len(clean) == len(self._clean), "a block appears twice in the clean queue")
        _require(not (clean & evict), f"blocks both clean and cached: {sorted(clean & evict)[:8]}")
        _require(not (used & (clean | evict)),
                 f"referenced blocks in the free list: {sorted(used & (clean | evict))[:8]}")
        _require(len(clean) + len(evict) + len(used) == self.num_blocks,
                 f"free {len(clean)} + cached {len(evict)} + used {len(used)} != total {self.num_blocks}")
        _require(all(r >= 0 for r in self._ref), "negative ref count")
        _require(all(b in self._hash_of for b in evict), "a cached block has no hash")
        _require(not (clean & set(self._hash_of)), "a clean block still has a hash")
        for h, b in self._block_of.items():
            _require(self._hash_of.get(b) == h, f"hash map and block map disagree at block {b}")
        _require(len(self._block_of) == len(self._hash_of), "hash maps differ in size")
        if expected_refs is not None:
            bad = [b for b in expected_refs
                   if not (isinstance(b, (int, np.integer)) and 0 <= b < self.num_blocks)]
            _require(not bad, f"tables name unknown block ids {bad[:8]}")
            for b in range(self.num_blocks):
                want = expected_refs.get(b, 0)
                _require(self._ref[b] == want,
                         f"block {b}: ref count {self._ref[b]}, tables name it {want} times")
