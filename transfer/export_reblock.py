"""Re-blocking on the sender: a sequence's KV gathered from sender-sized pool blocks into the
receiver's block size, in the order the wire carries it, so the receiver lands every byte
straight in its own blocks (no staging and no re-block copy on the decode worker's loop).

One strided copy per overlapping (sender block, receiver block) pair (`reblock.reblock_copy`,
the same copy the receiver would otherwise make), into one contiguous buffer holding only the
receiver blocks that are sent; the tail of a partial last block is zeroed. The buffer is a copy,
so the export needs no lease on the pool blocks. Runs on whatever thread builds the export.
"""

from __future__ import annotations

import torch

from kvcache.storage import KVStorage
from kvcache.table import blocks_for
from transfer.reblock import reblock_copy


def gather_reblocked(storage: KVStorage, blocks: list[int], num_tokens: int, block_size: int,
                     sent: list[int]) -> torch.Tensor:
    """(len(sent), L, 2, block_size, H, D) host tensor: receiver logical blocks `sent` (increasing)
    of the sequence whose sender logical block i is pool block `blocks[i]`."""
    data = storage.data  # (N, L, 2, Bs, H, D)
    _, L, two, _, H, D = data.shape
    out = torch.empty((len(sent), L, two, block_size, H, D), dtype=data.dtype, device=data.device)
    rows: list[int | None] = [None] * blocks_for(num_tokens, block_size)
    for row, j in enumerate(sent):
        rows[j] = row
    reblock_copy(out, rows, data, list(blocks), num_tokens)
    last, valid = len(rows) - 1, num_tokens - (len(rows) - 1) * block_size
    if rows[last] is not None and valid < block_size:
        out[rows[last], :, :, valid:] = 0  # the unused slots of a partial last block
    if out.device.type != "cpu":
        out = out.cpu()
    return out


def block_runs(sent: list[int], max_blocks: int, adjacent=None) -> list[list[int]]:
    """[first logical block, count] runs of consecutive sent blocks, each at most max_blocks (and,
    given `adjacent(j)`, only where block j may join the block before it)."""
    runs: list[list[int]] = []
    for j in sent:
        r = runs[-1] if runs else None
        if r and r[0] + r[1] == j and r[1] < max_blocks and (adjacent is None or adjacent(j)):
            r[1] += 1
        else:
            runs.append([j, 1])
    return runs
