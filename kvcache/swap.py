"""Swapping sequences' blocks between the device pool and the host pool.

`KVCacheManager.swap_out` / `swap_in` delegate here. A request's sequences (n > 1 forks, beams)
share blocks, so they swap as one group: each distinct block is copied once, in one gather /
scatter, and the blocks the sequences shared stay shared on the other side (one block, one
reference per table). Both directions release the blocks they left (tail first) and repoint the
tables; both return False and change nothing when the destination pool is short. A swapped-out
table holds host block ids and is frozen (no append, fork or slot mapping) until swapped back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvcache.manager import KVCacheManager


def _distinct(tables) -> list[int]:
    """Every block the tables name, once, in first-seen order."""
    return list(dict.fromkeys(b for table in tables for b in table.blocks))


def _move(tables, source_alloc, target_alloc, source_data, target_data) -> dict[int, int] | None:
    """Copy the tables' distinct blocks into new target blocks; None (nothing changed) on shortage.
    Returns source block -> target block; each target block gets one reference per table naming it."""
    blocks = _distinct(tables)
    fresh = target_alloc.allocate_many(len(blocks))
    if fresh is None:
        return None
    mapping = dict(zip(blocks, fresh))
    for table in tables:  # allocate gave one reference; every further table naming it adds one
        for block in table.blocks:
            target_alloc.incref(mapping[block])
    for block in fresh:
        target_alloc.free(block)
    source = torch.tensor(blocks, dtype=torch.long, device=source_data.device)
    target = torch.tensor(fresh, dtype=torch.long, device=target_data.device)
    target_data[target] = source_data[source].to(target_data.device)  # (n, L, 2, B, H, D)
    for table in tables:
        source_alloc.free_many(table.blocks[::-1])
        table.blocks = [mapping[b] for b in table.blocks]
    return mapping


def swap_out(manager: KVCacheManager, seq_ids) -> bool:
    """Move the sequences' blocks to the host pool together. False when the host pool is short."""
    tables = [manager.table(seq_id) for seq_id in seq_ids]
    if manager.host_storage is None or manager.storage is None:
        raise ValueError("swap needs a device storage and a host storage")
    if any(table.swapped for table in tables):
        raise ValueError("a sequence of the group is already swapped out")
    if _move(tables, manager.allocator, manager.host_allocator, manager.storage.data,
             manager.host_storage.data) is None:
        return False
    for table in tables:
        table.swapped = True
    return True


def swap_in(manager: KVCacheManager, seq_ids) -> bool:
    """Bring swapped-out sequences back into the device pool together. False on shortage."""
    tables = [manager.table(seq_id) for seq_id in seq_ids]
    if not all(table.swapped for table in tables):
        raise ValueError("a sequence of the group is not swapped out")
    mapping = _move(tables, manager.host_allocator, manager.allocator, manager.host_storage.data,
                    manager.storage.data)
    if mapping is None:
        return False
    for table in tables:
        table.swapped = False
        # Its full blocks are the only copy now if the cache evicted the originals: re-register.
        for block, block_hash in zip(table.blocks, table.block_hashes):
            manager.allocator.register(block, block_hash)
    return True


def blocks_needed(manager: KVCacheManager, seq_ids) -> int:
    """Distinct blocks a group of swapped-out sequences needs to come back."""
    return len(_distinct(manager.table(seq_id) for seq_id in seq_ids))
