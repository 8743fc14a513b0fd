"""Swapping one sequence's blocks between the device pool and the host pool.

`KVCacheManager.swap_out` / `swap_in` delegate here. Each copies the sequence's K/V in one
gather/scatter, releases the blocks it left (tail first), and repoints the table; both return
False and change nothing when the destination pool is short. A swapped-out table holds host
block ids and is frozen (no append, fork or slot mapping) until it is swapped back in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvcache.manager import KVCacheManager


def swap_out(manager: KVCacheManager, seq_id) -> bool:
    """Move the sequence's blocks to the host pool. False when the host pool is full."""
    table = manager.table(seq_id)
    device, host = manager.storage, manager.host_storage
    if host is None or device is None:
        raise ValueError("swap needs a device storage and a host storage")
    if table.swapped:
        raise ValueError(f"sequence {seq_id!r} is already swapped out")
    host_blocks = manager.host_allocator.allocate_many(len(table.blocks))  # type: ignore[union-attr]
    if host_blocks is None:
        return False
    source = torch.tensor(table.blocks, dtype=torch.long, device=device.device)
    target = torch.tensor(host_blocks, dtype=torch.long)
    host.data[target] = device.data[source].to(host.device)
    manager.allocator.free_many(table.blocks[::-1])
    table.blocks, table.swapped = host_blocks, True
    return True


def swap_in(manager: KVCacheManager, seq_id) -> bool:
    """Bring a swapped-out sequence back into the device pool. False on shortage."""
    table = manager.table(seq_id)
    if not table.swapped:
        raise ValueError(f"sequence {seq_id!r} is not swapped out")
    device, host = manager.storage, manager.host_storage
    device_blocks = manager.allocator.allocate_many(len(table.blocks))
    if device_blocks is None:
        return False
    source = torch.tensor(table.blocks, dtype=torch.long)
    target = torch.tensor(device_blocks, dtype=torch.long, device=device.device)  # type: ignore[union-attr]
    device.data[target] = host.data[source].to(device.device)  # type: ignore[union-attr]
    manager.host_allocator.free_many(table.blocks[::-1])  # type: ignore[union-attr]
    table.blocks, table.swapped = device_blocks, False
    # Its full blocks are the only copy now if the cache evicted the originals: re-register.
    for block, block_hash in zip(device_blocks, table.block_hashes):
        manager.allocator.register(block, block_hash)
    return True
