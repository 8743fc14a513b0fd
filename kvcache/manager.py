"""KV cache manager: per-sequence block tables over a block allocator and a KV storage.

This is the layer that knows about sequences (by opaque id) but not about requests, models or
transports. It owns the block tables (`kvcache.table`: logical block -> physical block, tail
fill), prefix matching and registration of full blocks, fork, copy-on-write of a shared tail,
tail-first release, swapping a sequence's blocks to a host pool and back (the copies are in
`kvcache.swap`) and the table-level integrity check (`kvcache.integrity`). Rules kept here: only
full blocks whose KV has been computed are ever shared through the prefix cache; tables only grow
(until freed); copy-on-write is the one explicit `_cow_tail` call made before a write into a
shared tail block. Shortage returns None/False and changes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvcache import integrity, swap
from kvcache.allocator import ROOT_HASH, BlockAllocator
from kvcache.storage import KVStorage
from kvcache.table import BlockTable, blocks_for
from protocol.prefix_hash import hash_chain

__all__ = ["BlockTable", "KVCacheManager", "blocks_for"]  # the table's names, re-exported for callers


class KVCacheManager:
    """Block tables plus the policies that keep them consistent with the allocator."""

    def __init__(self, allocator: BlockAllocator, block_size: int, storage: KVStorage | None = None,
                 enable_prefix_caching: bool = True, host_storage: KVStorage | None = None,
                 held_back: Callable[[], int] | None = None):
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
        # blocks promised to coming imports but not allocated yet (the decode role passes its count):
        # the scheduler's growth and admission must leave them
        self.held_back: Callable[[], int] = held_back or (lambda: 0)
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

    def available(self) -> int:
        """Blocks the scheduler may give to running or admitted sequences: what `allocate` can hand
        out, minus those promised to imports (`held_back`; imports allocate directly)."""
        return self.allocator.num_available - self.held_back()

    def prefix_hashes(self, token_ids: list[int], extra_key: str | None = None) -> list[int]:
        """Chained hashes of every full block of `token_ids`."""
        return hash_chain(token_ids, self.block_size, extra_key)

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
        table = self.table(seq_id)
        if table.swapped:
            raise ValueError(f"sequence {seq_id!r} is swapped out; its blocks are host ids")
        if not 0 <= start <= end <= table.num_tokens:
            raise ValueError(f"token range {start}..{end} outside 0..{table.num_tokens}")
        return [table.slot(i, self.block_size) for i in range(start, end)]

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
        if need + revived > self.available():
            return None
        hashes = self.prefix_hashes(token_ids[:len(hits) * self.block_size], extra_key)
        blocks = [self.allocator.acquire_cached(h) for h in hashes]
        blocks += self.allocator.allocate_many(need)  # type: ignore[operator]
        computed = len(hits) * self.block_size
        self.tables[seq_id] = BlockTable(blocks=blocks, token_ids=list(token_ids), num_computed=computed,
                                         block_hashes=hashes, extra_key=extra_key)
        self.prefix_hit_tokens += computed
        return computed

    def _tail_takes_one(self, table: BlockTable) -> bool:
        """One more token fits the last block in place: it has room and only this table holds it
        (the common decode step; `append` and `blocks_needed_to_append` skip their general path)."""
        return not table.swapped and len(table.token_ids) < len(table.blocks) * self.block_size \
            and self.allocator.ref_count(table.blocks[-1]) == 1

    def blocks_needed_to_append(self, seq_id, n: int = 1) -> int:
        """New blocks `append` would take for n more tokens (copy-on-write included)."""
        table = self.table(seq_id)
        if n == 1 and self._tail_takes_one(table):
            return 0
        if table.swapped:
            raise ValueError(f"sequence {seq_id!r} is swapped out; swap it in before appending")
        if n < 0:
            raise ValueError(f"cannot append a negative number of tokens ({n})")
        if n == 0:
            return 0
        B = self.block_size
        need = blocks_for(table.num_tokens + n, B) - len(table.blocks)
        fill = table.tail_fill(B)
        if table.blocks and 0 < fill < B and self.allocator.ref_count(table.blocks[-1]) > 1:
            need += 1
        return need

    def append(self, seq_id, token_ids: list[int]) -> bool:
        """Timed `_append` (see there)."""
        t0 = time.perf_counter()
        table = self.tables.get(seq_id)
        if table is not None and len(token_ids) == 1 and self._tail_takes_one(table):
            table.token_ids.append(token_ids[0])  # no block moves: 2-3x faster than the general path
            self.alloc_calls += 1
            self.alloc_seconds += time.perf_counter() - t0
            return True
        try:
            return self._append(seq_id, token_ids)
        finally:
            self.alloc_calls += 1
            self.alloc_seconds += time.perf_counter() - t0

    def _append(self, seq_id, token_ids: list[int]) -> bool:
        """Give `token_ids` slots at the end of the sequence. False on shortage (no change)."""
        table = self.table(seq_id)
        if table.swapped:
            raise ValueError(f"sequence {seq_id!r} is swapped out; swap it in before appending")
        if not token_ids:  # nothing to place: no copy-on-write either
            return True
        if self.blocks_needed_to_append(seq_id, len(token_ids)) > self.available():
            return False
        self._cow_tail(table)
        new = blocks_for(table.num_tokens + len(token_ids), self.block_size) - len(table.blocks)
        table.blocks += self.allocator.allocate_many(new)  # type: ignore[operator]
        table.token_ids += token_ids
        return True

    def _cow_tail(self, table: BlockTable) -> None:
        """Copy-on-write: before writing into a shared, partly filled tail, take a private copy."""
        B = self.block_size
        fill = table.tail_fill(B)
        if not table.blocks or fill in (0, B) or self.allocator.ref_count(table.blocks[-1]) == 1:
            return
        old = table.blocks[-1]
        new = self.allocator.allocate()
        if new is None:  # callers checked availability first
            raise RuntimeError("copy-on-write found no free block after the availability check")
        if self.storage is not None:
            self.storage.copy_blocks([(old, new)])
        self.allocator.free(old)
        table.blocks[-1] = new
        self.cow_copies += 1

    def mark_computed(self, seq_id, num_computed: int) -> None:
        """Record that the first `num_computed` tokens have K/V written; seal full blocks."""
        table = self.table(seq_id)
        if not 0 <= num_computed <= table.num_tokens:
            raise ValueError(f"num_computed {num_computed} outside 0..{table.num_tokens}")
        table.num_computed = max(table.num_computed, num_computed)
        if not self.enable_prefix_caching or table.swapped or \
                table.num_computed // self.block_size <= len(table.block_hashes):  # no new full block
            return
        B = self.block_size
        parent = table.block_hashes[-1] if table.block_hashes else ROOT_HASH
        first = len(table.block_hashes)
        for i, h in enumerate(hash_chain(table.token_ids, B, table.extra_key, parent, first,
                                         table.num_computed // B), first):
            table.block_hashes.append(h)
            self.allocator.register(table.blocks[i], h)

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
        parent = self.table(parent_id)
        if parent.swapped:
            raise ValueError(f"cannot fork swapped-out sequence {parent_id!r}")
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id!r} already has a block table")
        for b in parent.blocks:
            self.allocator.incref(b)
        self.tables[child_id] = BlockTable(blocks=list(parent.blocks), token_ids=list(parent.token_ids),
                                           num_computed=parent.num_computed,
                                           block_hashes=list(parent.block_hashes), extra_key=parent.extra_key)

    def free(self, seq_id, uncache: bool = False) -> None:
        """Release every block of the sequence, tail first, and forget its table.

        uncache: blocks whose last reference this drops leave the prefix cache too (see
        `BlockAllocator.free`)."""
        table = self.tables.get(seq_id)
        if table is None:
            raise ValueError(f"free of unknown sequence {seq_id!r}")
        alloc = self.host_allocator if table.swapped else self.allocator
        alloc.free_many(table.blocks[::-1], uncache)  # type: ignore[union-attr]
        del self.tables[seq_id]  # only once the blocks are released: a failure keeps the table

    # ---- swap (the copies are in kvcache.swap) ------------------------------------------
    def swap_out(self, seq_id) -> bool:
        """Move the sequence's blocks to the host pool. False when the host pool is full."""
        return swap.swap_out(self, [seq_id])

    def swap_in(self, seq_id) -> bool:
        """Bring a swapped-out sequence back into the device pool. False on shortage."""
        return swap.swap_in(self, [seq_id])

    def swap_out_group(self, seq_ids) -> bool:
        """Swap out sequences that share blocks (one request's): shared blocks copied once and kept
        shared on the host. False, and nothing changed, when the host pool is short."""
        return swap.swap_out(self, list(seq_ids))

    def swap_in_group(self, seq_ids) -> bool:
        """Swap a group back in, sharing preserved. False, nothing changed, on shortage."""
        return swap.swap_in(self, list(seq_ids))

    def swap_in_blocks(self, seq_ids) -> int:
        """Device blocks a swapped-out group needs to come back (shared blocks counted once)."""
        return swap.blocks_needed(self, list(seq_ids))

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
        """Allocator invariants plus: each block's ref count equals the tables naming it
        (`kvcache.integrity`). extra_refs: references held outside the tables (a migration lease)."""
        integrity.check_manager(self, extra_refs)
