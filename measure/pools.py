"""Synthetic KV pools for the migration benchmark (`measure.migrate`) and the tests: build a manager
over a pool, give a sequence random non-zero KV (so a transfer that writes nothing cannot pass),
and compute a canonical digest of a sequence's KV that does not depend on block size or placement
(ordered by layer, key/value, token, head, channel), so sender and receiver can compare without a
copy. Nothing in the runtime uses these pools; workers build theirs from the engine's config.
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash

from kvcache.allocator import BlockAllocator
from kvcache.manager import KVCacheManager, blocks_for
from kvcache.storage import KVLayout, KVStorage

PRESETS = {
    # name: (num_layers, num_kv_heads, head_dim, dtype)
    "tiny": (2, 2, 16, "float16"),
    "llama3-8b": (32, 8, 128, "bfloat16"),
}


def parse_kv_shape(spec: str) -> tuple[int, int, int, str]:
    """'tiny', 'llama3-8b' or 'L,H,D,dtype' (e.g. '4,2,64,float16')."""
    if spec in PRESETS:
        return PRESETS[spec]
    parts = spec.split(",")
    if len(parts) != 4:
        raise ValueError(f"kv shape {spec!r}: expected a preset {sorted(PRESETS)} or L,H,D,dtype")
    L, H, D = (int(p) for p in parts[:3])
    KVLayout(L, H, D, 1, parts[3])  # validates
    return L, H, D, parts[3]


def make_manager(layout: KVLayout, num_blocks: int, device: str = "cpu", prefix_caching: bool = True,
                 prefault: bool = False, shm: bool = False) -> KVCacheManager:
    """prefault: write every page of the pool once (a long-running worker's pool is mapped; a
    fresh zeros tensor is not, and first-touch page faults would otherwise pollute timings).
    shm: the pool in a /dev/shm file, as a prefill worker on the Ray transport keeps it."""
    storage = KVStorage(layout, num_blocks, device=device, shm=shm)
    if prefault:
        storage.data.view(torch.uint8).fill_(0)
    return KVCacheManager(BlockAllocator(num_blocks), layout.block_size, storage,
                          enable_prefix_caching=prefix_caching)


def fill_random_sequence(manager: KVCacheManager, seq_id, num_tokens: int, gen: torch.Generator,
                         token_ids: list[int] | None = None, extra_key: str | None = None) -> list[int]:
    """Allocate `seq_id`, write random non-zero bytes into its new blocks, mark all computed."""
    if token_ids is None:
        token_ids = torch.randint(0, 50_000, (num_tokens,), generator=gen).tolist()
    hit = manager.allocate(seq_id, token_ids, extra_key)
    if hit is None:
        raise RuntimeError(f"pool too small for {num_tokens} tokens")
    t = manager.table(seq_id)
    B = manager.block_size
    data = manager.storage.data
    for i in range(hit // B, blocks_for(num_tokens, B)):
        blk = data[t.blocks[i]].view(torch.uint8)  # (L, 2, B, H, D * elem)
        blk.copy_(torch.randint(1, 256, blk.shape, dtype=torch.uint8, generator=gen))
    manager.mark_computed(seq_id, num_tokens)
    return token_ids


def kv_digest(manager: KVCacheManager, seq_id) -> int:
    """xxh3-64 of the sequence's computed KV in canonical (layer, kv, token, head, dim) order."""
    t = manager.table(seq_id)
    data, B, n = manager.storage.data, manager.block_size, t.num_computed
    if data.device.type != "cpu":
        data = data[torch.tensor(t.blocks[:blocks_for(n, B)], device=data.device)].cpu()
        blocks = list(range(data.shape[0]))
    else:
        blocks = t.blocks[:blocks_for(n, B)]
    arr = data.view(torch.uint8).numpy()  # (N, L, 2, B, H, D * elem) bytes
    h = xxhash.xxh3_64()
    for layer in range(arr.shape[1]):
        for kv in range(2):
            for i, b in enumerate(blocks):
                valid = min(B, n - i * B)
                h.update(np.ascontiguousarray(arr[b, layer, kv, :valid]))
    return h.intdigest()


def scrub_blocks(manager: KVCacheManager, blocks: list[int]) -> None:
    """Zero blocks (before they are freed) so a later transfer must really rewrite them."""
    if blocks:
        manager.storage.data[torch.tensor(blocks, device=manager.storage.device)] = 0
