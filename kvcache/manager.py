"""KV cache manager: per-sequence block tables over a block allocator and a KV storage.

This is the layer that knows about sequences (by opaque id) but not about requests, models or
transports. It owns the block tables (logical block -> physical block, tail fill), prefix
matching and registration of full blocks, fork, copy-on-write of a shared tail, tail-first
release, and swapping a sequence's blocks to a host pool and back.

Rules kept here: only full blocks whose KV has been computed are ever shared through the prefix
cache; tables only grow (until freed); copy-on-write is the one explicit `_cow_tail` call made
before a write into a shared tail block. Shortage returns None/False and changes nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvcache.allocator import ROOT_HASH, BlockAllocator, IntegrityError, hash_block
from kvcache.storage import KVStorage


@dataclass
class BlockTable:
    """One sequence's view of the cache.

    blocks: physical block ids in logical order (host ids while swapped out).
    token_ids: every token that has a slot (computed or about to be).
    num_computed: tokens whose K/V are written into their slots.
    block_hashes: prefix hashes of the leading full, computed blocks.
    """

    blocks: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_hashes: list[int] = field(default_factory=list)
    extra_key: str | None = None
    swapped: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def slot(self, t: int, block_size: int) -> int:
        """Physical slot of logical token t: table[t // B] * B + t % B."""
        return self.blocks[t // block_size] * block_size + t % block_size

    def tail_fill(self, block_size: int) -> int:
        """Tokens in the last block (block_size when it is full, 0 when there are no blocks)."""
        if not self.blocks:
            return 0
        return self.num_tokens - (len(self.blocks) - 1) * block_size


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise IntegrityError(msg)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Block tables plus the policies that keep them consistent with the allocator."""

    def __init__(self, allocator: BlockAllocator, block_size: int, storage: KVStorage | None = None,
                 enable_prefix_caching: bool = True, host_storage: KVStorage | None = None):
        if storage is not None and storage.num_blocks != allocator.num_blocks:
            raise ValueError("storage and allocator disagree on the number of blocks")
        if storage is not None and storage.layout.block_size != block_size:
            raise ValueError("storage block size differs from the manager's")
        if host_storage is not None and host_storage.layout.block_size != block_size:
            raise ValueError("host storage block size differs from the manager's")
        if storage is not None and host_storage is not None and host_storage.layout != storage.layout:
            raise ValueError(f"host storage layout {host_storage.layout} differs from the device "
                             f"storage layout {storage.layout}; swapped blocks would not fit")
        self.allocator = allocator
        self.block_size = block_size
        self.storage = storage
        self.enable_prefix_caching = enable_prefix_caching
        self.host_storage = host_storage
        self.host_allocator = BlockAllocator(host_storage.num_blocks) if host_storage is not None else None
        self.tables: dict[object, BlockTable] = {}
        self.cow_copies = 0
        self.prefix_hit_tokens = 0
        self.alloc_calls = 0  # allocate/append calls, and the seconds they took (allocation latency)
        self.alloc_seconds = 0.0

    # ---- queries ------------------------------------------------------------------------
    def table(self, seq_id) -> BlockTable:
        try:
            return self.tables[seq_id]
        except KeyError:
            raise ValueError(f"unknown sequence {seq_id!r}") from None

    def prefix_hashes(self, token_ids: list[int], extra_key: str | None = None) -> list[int]:
        """Chained hashes of every full block of `token_ids`."""
        B, out, parent = self.block_size, [], ROOT_HASH
        for i in range(len(token_ids) // B):
            parent = hash_block(parent, token_ids[i * B:(i + 1) * B], extra_key)
            out.append(parent)
        return out

    def match_prefix(self, token_ids: list[int], extra_key: str | None = None) -> list[int]:
        """Cached blocks holding the longest prefix of `token_ids` (no references taken).

        At most (len - 1) // B blocks match, so at least the last prompt token is always
        computed (its logits are needed).
        """
        if not self.enable_prefix_caching:
            return []
        limit = (len(token_ids) - 1) // self.block_size
        found = []
        for h in self.prefix_hashes(token_ids[:limit * self.block_size], extra_key):
            b = self.allocator.lookup(h)
            if b is None:
                break
            found.append(b)
        return found

    def slot_mapping(self, seq_id, start: int, end: int) -> list[int]:
        """Physical slots of tokens start..end-1 (each must already have a slot)."""
        t = self.table(seq_id)
        if t.swapped:
            raise ValueError(f"sequence {seq_id!r} is swapped out; its blocks are host ids")
        if not 0 <= start <= end <= t.num_tokens:
            raise ValueError(f"token range {start}..{end} outside 0..{t.num_tokens}")
        return [t.slot(i, self.block_size) for i in range(start, end)]

    # ---- allocate / grow ----------------------------------------------------------------
    def allocate(self, seq_id, token_ids: list[int], extra_key: str | None = None) -> int | None:
        """Timed `_allocate` (see there)."""
        t0 = time.perf_counter()
        try:
            return self._allocate(seq_id, token_ids, extra_key)
        finally:
            self.alloc_calls += 1
            self.alloc_seconds += time.perf_counter() - t0

    def _allocate(self, seq_id, token_ids: list[int], extra_key: str | None = None) -> int | None:
        """Create a table with slots for `token_ids`, reusing cached prefix blocks.

        Returns how many leading tokens are already computed (prefix-cache hit), or None on
        shortage (nothing changed).
        """
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table")
        if not token_ids:
            raise ValueError("cannot allocate a sequence with no tokens")
        hits = self.match_prefix(token_ids, extra_key)
        revived = sum(1 for b in hits if self.allocator.ref_count(b) == 0)
        need = blocks_for(len(token_ids), self.block_size) - len(hits)
        if need + revived > self.allocator.num_available:
            return None
        hashes = self.prefix_hashes(token_ids[:len(hits) * self.block_size], extra_key)
        blocks = [self.allocator.acquire_cached(h) for h in hashes]
        blocks += self.allocator.allocate_many(need)  # type: ignore[operator]
        computed = len(hits) * self.block_size
        self.tables[seq_id] = BlockTable(blocks=blocks, token_ids=list(token_ids), num_computed=computed,
                                         block_hashes=hashes, extra_key=extra_key)
        self.prefix_hit_tokens += computed
        return computed

    def blocks_needed_to_append(self, seq_id, n: int = 1) -> int:
        """New blocks `append` would take for n more tokens (copy-on-write included)."""
        t = self.table(seq_id)
        if t.swapped:
            raise ValueError(f"sequence {seq_id!r} is swapped out; swap it in before appending")
        if n < 0:
            raise ValueError(f"cannot append a negative number of tokens ({n})")
        if n == 0:
            return 0
        B = self.block_size
        need = blocks_for(t.num_tokens + n, B) - len(t.blocks)
        fill = t.tail_fill(B)
        if t.blocks and 0 < fill < B and self.allocator.ref_count(t.blocks[-1]) > 1:
            need += 1
        return need

    def append(self, seq_id, token_ids: list[int]) -> bool:
        """Timed `_append` (see there)."""
        t0 = time.perf_counter()
        try:
            return self._append(seq_id, token_ids)
        finally:
            self.alloc_calls += 1
            self.alloc_seconds += time.perf_counter() - t0

    def _append(self, seq_id, token_ids: list[int]) -> bool:
        """Give `token_ids` slots at the end of the sequence. False on shortage (no change)."""
        t = self.table(seq_id)
        if t.swapped:
            raise ValueError(f"sequence {seq_id!r} is swapped out; swap it in before appending")
        if not token_ids:  # nothing to place: no copy-on-write either
            return True
        if self.blocks_needed_to_append(seq_id, len(token_ids)) > self.allocator.num_available:
            return False
        self._cow_tail(t)
        new = blocks_for(t.num_tokens + len(token_ids), self.block_size) - len(t.blocks)
        t.blocks += self.allocator.allocate_many(new)  # type: ignore[operator]
        t.token_ids += token_ids
        return True

    def _cow_tail(self, t: BlockTable) -> None:
        """Copy-on-write: before writing into a shared, partly filled tail, take a private copy."""
        B = self.block_size
        fill = t.tail_fill(B)
        if not t.blocks or fill in (0, B) or self.allocator.ref_count(t.blocks[-1]) == 1:
            return
        old = t.blocks[-1]
        new = self.allocator.allocate()
        if new is None:  # callers checked availability first
            raise RuntimeError("copy-on-write found no free block after the availability check")
        if self.storage is not None:
            self.storage.copy_blocks([(old, new)])
        self.allocator.free(old)
        t.blocks[-1] = new
        self.cow_copies += 1

    def mark_computed(self, seq_id, num_computed: int) -> None:
        """Record that the first `num_computed` tokens have K/V written; seal full blocks."""
        t = self.table(seq_id)
        if not 0 <= num_computed <= t.num_tokens:
            raise ValueError(f"num_computed {num_computed} outside 0..{t.num_tokens}")
        t.num_computed = max(t.num_computed, num_computed)
        if not self.enable_prefix_caching or t.swapped:
            return
        B = self.block_size
        parent = t.block_hashes[-1] if t.block_hashes else ROOT_HASH
        for i in range(len(t.block_hashes), t.num_computed // B):
            parent = hash_block(parent, t.token_ids[i * B:(i + 1) * B], t.extra_key)
            t.block_hashes.append(parent)
            self.allocator.register(t.blocks[i], parent)

    def adopt(self, seq_id, blocks: list[int], token_ids: list[int], extra_key: str | None = None) -> None:
        """Make a table from blocks the caller already holds one reference to (KV import)."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table")
        if len(blocks) != blocks_for(len(token_ids), self.block_size):
            raise ValueError(f"{len(blocks)} blocks cannot hold exactly {len(token_ids)} tokens")
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"adopt got a block twice: {list(blocks)}")
        blocks = [int(b) for b in blocks]
        for b in blocks:
            if self.allocator.ref_count(b) < 1:
                raise ValueError(f"adopt of block {b}, which the caller does not hold (ref count 0)")
        self.tables[seq_id] = BlockTable(blocks=list(blocks), token_ids=list(token_ids), extra_key=extra_key)
        self.mark_computed(seq_id, len(token_ids))

    # ---- fork / free --------------------------------------------------------------------
    def fork(self, parent_id, child_id) -> None:
        """The child shares every block of the parent (+1 ref each); writes copy-on-write."""
        p = self.table(parent_id)
        if p.swapped:
            raise ValueError(f"cannot fork swapped-out sequence {parent_id!r}")
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id!r} already has a block table")
        for b in p.blocks:
            self.allocator.incref(b)
        self.tables[child_id] = BlockTable(blocks=list(p.blocks), token_ids=list(p.token_ids),
                                           num_computed=p.num_computed, block_hashes=list(p.block_hashes),
                                           extra_key=p.extra_key)

    def free(self, seq_id, uncache: bool = False) -> None:
        """Release every block of the sequence, tail first, and forget its table.

        uncache: blocks whose last reference this drops leave the prefix cache too (see
        `BlockAllocator.free`)."""
        t = self.tables.get(seq_id)
        if t is None:
            raise ValueError(f"free of unknown sequence {seq_id!r}")
        alloc = self.host_allocator if t.swapped else self.allocator
        alloc.free_many(t.blocks[::-1], uncache)  # type: ignore[union-attr]
        del self.tables[seq_id]  # only once the blocks are released: a failure keeps the table

    # ---- swap ---------------------------------------------------------------------------
    def swap_out(self, seq_id) -> bool:
        """Move the sequence's blocks to the host pool. False when the host pool is full."""
        t = self.table(seq_id)
        if self.host_storage is None or self.storage is None:
            raise ValueError("swap needs a device storage and a host storage")
        if t.swapped:
            raise ValueError(f"sequence {seq_id!r} is already swapped out")
        host = self.host_allocator.allocate_many(len(t.blocks))  # type: ignore[union-attr]
        if host is None:
            return False
        src = torch.tensor(t.blocks, dtype=torch.long, device=self.storage.device)
        dst = torch.tensor(host, dtype=torch.long)
        self.host_storage.data[dst] = self.storage.data[src].to(self.host_storage.device)
        self.allocator.free_many(t.blocks[::-1])
        t.blocks, t.swapped = host, True
        return True

    def swap_in(self, seq_id) -> bool:
        """Bring a swapped-out sequence back into the device pool. False on shortage."""
        t = self.table(seq_id)
        if not t.swapped:
            raise ValueError(f"sequence {seq_id!r} is not swapped out")
        dev = self.allocator.allocate_many(len(t.blocks))
        if dev is None:
            return False
        src = torch.tensor(t.blocks, dtype=torch.long)
        dst = torch.tensor(dev, dtype=torch.long, device=self.storage.device)  # type: ignore[union-attr]
        self.storage.data[dst] = self.host_storage.data[src].to(self.storage.device)  # type: ignore[union-attr]
        self.host_allocator.free_many(t.blocks[::-1])  # type: ignore[union-attr]
        t.blocks, t.swapped = dev, False
        # Its full blocks are the only copy now if the cache evicted the originals: re-register.
        for i, h in enumerate(t.block_hashes):
            self.allocator.register(dev[i], h)
        return True

    # ---- accounting ---------------------------------------------------------------------
    def usage(self) -> dict:
        """Pool counts plus tail-slot waste (allocated minus filled slots) of resident tables."""
        a, B = self.allocator, self.block_size
        resident = [t for t in self.tables.values() if not t.swapped]
        return {
            "total_blocks": a.num_blocks, "free_blocks": a.num_free, "cached_blocks": a.num_cached,
            "used_blocks": a.num_used, "block_size": B,
            "tail_waste_slots": sum(len(t.blocks) * B - t.num_tokens for t in resident),
            "swapped_sequences": len(self.tables) - len(resident),
            "alloc_calls": self.alloc_calls, "alloc_seconds": self.alloc_seconds,
        }

    def check_integrity(self, extra_refs: dict[int, int] | None = None) -> None:
        """Allocator invariants plus: each block's ref count equals the tables naming it.

        extra_refs: references held outside the tables (e.g. a migration lease).
        """
        dev: dict[int, int] = dict(extra_refs or {})
        host: dict[int, int] = {}
        B = self.block_size
        for seq_id, t in self.tables.items():
            _require(len(t.blocks) == blocks_for(t.num_tokens, B),
                     f"sequence {seq_id!r}: {len(t.blocks)} blocks for {t.num_tokens} tokens")
            _require(len(set(t.blocks)) == len(t.blocks), f"sequence {seq_id!r} names a block twice")
            _require(0 <= t.num_computed <= t.num_tokens,
                     f"sequence {seq_id!r}: {t.num_computed} computed of {t.num_tokens} tokens")
            _require(len(t.block_hashes) <= t.num_computed // B,
                     f"sequence {seq_id!r}: {len(t.block_hashes)} sealed blocks, {t.num_computed} computed")
            _require(not t.swapped or self.host_allocator is not None,
                     f"sequence {seq_id!r} is swapped out but there is no host pool")
            counts = host if t.swapped else dev
            for b in t.blocks:
                counts[b] = counts.get(b, 0) + 1
        self.allocator.check_integrity(dev)
        if self.host_allocator is not None:
            self.host_allocator.check_integrity(host)
