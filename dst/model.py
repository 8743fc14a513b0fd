"""The deterministic fake model: the tokens and the K/V a prompt produces, known without an engine.

A token depends on the three before it and the position; a token's K/V depends on the token and
its position only, so equal prefixes have equal K/V (prefix caching and dedupe stay valid) and
any byte that lands wrong is detected by recomputing what should be there (`expected_kv`).
"""

from __future__ import annotations

import torch

from kvcache import BlockAllocator, KVCacheManager, KVLayout, KVStorage

VOCAB = 997
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, block_size=4)


def next_token(tokens: list[int]) -> int:
    return (sum(tokens[-3:]) * 31 + 7 * len(tokens) + 1) % VOCAB


def generate(prompt: list[int], n: int) -> list[int]:
    """The n tokens the fake model answers `prompt` with (the first one comes from prefill)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


def kv_of(token: int, position: int) -> float:
    return float((token * 131 + position * 7) % 4093) + 0.5


def make_manager(num_blocks: int) -> KVCacheManager:
    return KVCacheManager(BlockAllocator(num_blocks), LAYOUT.block_size, KVStorage(LAYOUT, num_blocks))


def write_kv(manager: KVCacheManager, seq_id, start: int, end: int) -> None:
    """Write the fake model's K/V for tokens start..end-1 of `seq_id` through its table."""
    table = manager.table(seq_id)
    L, H, D = LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim
    for pos, slot in zip(range(start, end), manager.slot_mapping(seq_id, start, end)):
        k = torch.full((L, H, D), kv_of(table.token_ids[pos], pos))
        manager.storage.write_slot(slot, k, -k)


def kv_matches(manager: KVCacheManager, seq_id, end: int) -> bool:
    """Whether the first `end` tokens of `seq_id` hold exactly the fake model's K/V."""
    table = manager.table(seq_id)
    got = manager.storage.read_slots(manager.slot_mapping(seq_id, 0, end))  # (T, L, 2, H, D)
    want = torch.tensor([kv_of(t, p) for p, t in enumerate(table.token_ids[:end])])
    want = want.view(-1, 1, 1, 1)  # (T, 1, 1, 1)
    return bool(torch.equal(got[:, :, 0], want.expand_as(got[:, :, 0]))
                and torch.equal(got[:, :, 1], -want.expand_as(got[:, :, 1])))
