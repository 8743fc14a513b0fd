"""The manager-level integrity check: every table is well formed (blocks match its token count,
no block named twice, computed and sealed counts in range, swapped only with a host pool) and
every block's reference count in each pool equals the number of tables naming it, plus the
references held outside the tables. `KVCacheManager.check_integrity` delegates here; the
allocator's own queue and hash invariants are checked by `BlockAllocator.check_integrity`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcache.allocator import IntegrityError
from kvcache.table import blocks_for

if TYPE_CHECKING:
    from kvcache.manager import KVCacheManager


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise IntegrityError(msg)


def check_manager(manager: KVCacheManager, extra_refs: dict[int, int] | None = None) -> None:
    """Raise IntegrityError on the first broken invariant (see the module docstring).

    extra_refs: device references held outside the tables (e.g. a migration lease).
    """
    device_refs: dict[int, int] = dict(extra_refs or {})
    host_refs: dict[int, int] = {}
    block_size = manager.block_size
    for seq_id, table in manager.tables.items():
        blocks, num_tokens, computed = table.blocks, table.num_tokens, table.num_computed
        _require(len(blocks) == blocks_for(num_tokens, block_size),
                 f"sequence {seq_id!r}: {len(blocks)} blocks for {num_tokens} tokens")
        _require(len(set(blocks)) == len(blocks), f"sequence {seq_id!r} names a block twice")
        _require(0 <= computed <= num_tokens,
                 f"sequence {seq_id!r}: {computed} computed of {num_tokens} tokens")
        _require(len(table.block_hashes) <= computed // block_size,
                 f"sequence {seq_id!r}: {len(table.block_hashes)} sealed blocks, {computed} computed")
        _require(not table.swapped or manager.host_allocator is not None,
                 f"sequence {seq_id!r} is swapped out but there is no host pool")
        counts = host_refs if table.swapped else device_refs
        for block in blocks:
            counts[block] = counts.get(block, 0) + 1
    manager.allocator.check_integrity(device_refs)
    if manager.host_allocator is not None:
        manager.host_allocator.check_integrity(host_refs)
