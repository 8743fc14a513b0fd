"""Helpers shared by the KVCacheManager tests (test_manager.py, test_manager_swap_checks.py):
tiny managers with a real KVStorage (and optionally a host pool), writing and reading distinct
K/V through a sequence's table, per-block reference counts, and a snapshot of the whole manager
state for "shortage changes nothing" checks."""

import torch

from kvcache import BlockAllocator, KVCacheManager, KVLayout, KVStorage

L, H, D = 2, 1, 2  # layers, KV heads, head dim: one token's K/V is (L, 2, H, D)


def make_manager(num_blocks: int, block_size: int, host_blocks: int = 0,
                 caching: bool = True) -> KVCacheManager:
    layout = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, block_size=block_size)
    host = KVStorage(layout, host_blocks) if host_blocks else None
    device = KVStorage(layout, num_blocks)
    return KVCacheManager(BlockAllocator(num_blocks), block_size, device, caching, host)


def write_kv(manager: KVCacheManager, seq, start: int, end: int, tag: float) -> None:
    """Write distinct K/V for tokens start..end-1 through the sequence's table."""
    for token, slot in zip(range(start, end), manager.slot_mapping(seq, start, end)):
        key = torch.full((L, H, D), tag + token)
        manager.storage.write_slot(slot, key, -key)


def read_kv(manager: KVCacheManager, seq, end: int) -> torch.Tensor:
    return manager.storage.read_slots(manager.slot_mapping(seq, 0, end))  # (T, L, 2, H, D)


def ref_counts(manager: KVCacheManager) -> list[int]:
    return [manager.allocator.ref_count(b) for b in range(manager.allocator.num_blocks)]


def snapshot(manager: KVCacheManager) -> tuple:
    """Tables, both free queues, ref counts, copy-on-write count and the device K/V."""
    allocator = manager.allocator
    return ({k: (list(t.blocks), list(t.token_ids), t.num_computed) for k, t in manager.tables.items()},
            list(allocator._clean), list(allocator._evictable), ref_counts(manager), manager.cow_copies,
            manager.storage.data.clone())


def same_state(x: tuple, y: tuple) -> bool:
    return x[:-1] == y[:-1] and torch.equal(x[-1], y[-1])
