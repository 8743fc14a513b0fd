"""Where an import's payload bytes land in the receiver's pool.

With equal block sizes a chunk is written straight into the reserved blocks: `pool_segments`
cuts it into (pool byte offset, length) runs, merging runs that are adjacent in the pool, and
`slot_segments` adds each run's offset inside a staging slot for the device path. With different
block sizes the whole payload is staged in logical order first and `reblock_staged` copies it
into the receiver-sized blocks at commit (`reblock.reblock_copy` does the strided copies).
"""

from __future__ import annotations

import numpy as np
import torch

from kvcache.storage import KVStorage
from transfer.reblock import reblock_copy
from transfer.wire_messages import FrameDesc


def pool_segments(frame: FrameDesc, chunk: int, chunk_bytes: int, block_bytes: int,
                  dst_blocks: list[int]) -> list[tuple[int, int]]:
    """(pool byte offset, length) runs that chunk `chunk` of `frame` lands in.

    block_bytes: bytes of one block (sender and receiver blocks are the same size here).
    dst_blocks[j]: the receiver's physical block for logical block j.
    """
    pos, end, segments = chunk * chunk_bytes, min((chunk + 1) * chunk_bytes, frame.nbytes), []
    while pos < end:
        offset = pos % block_bytes
        length = min(block_bytes - offset, end - pos)
        target = dst_blocks[frame.first_block + pos // block_bytes] * block_bytes + offset
        if segments and segments[-1][0] + segments[-1][1] == target:
            segments[-1] = (segments[-1][0], segments[-1][1] + length)
        else:
            segments.append((target, length))
        pos += length
    return segments


def slot_segments(segments: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(pool byte offset, offset in the staging slot, length) for each run of one chunk."""
    out, pos = [], 0
    for target, length in segments:
        out.append((target, pos, length))
        pos += length
    return out


def reblock_staged(storage: KVStorage, staging: np.ndarray, sent: list[bool], dst_blocks: list[int],
                   reused: set[int], src_block_size: int, num_tokens: int) -> None:
    """Copy the staged sender blocks (`sent` ones, in logical order) into the receiver's new
    blocks; blocks in `reused` already hold their tokens and are skipped."""
    layout = storage.layout
    rows, src_index = 0, []
    for was_sent in sent:
        src_index.append(rows if was_sent else None)
        rows += was_sent
    shape = (rows, layout.num_layers, 2, src_block_size, layout.num_kv_heads, layout.head_dim)
    if rows == 0:  # every block was reused: nothing landed (reblock_copy still checks coverage)
        src = torch.empty(shape, dtype=layout.torch_dtype)
    else:  # (S, L, 2, Bs, H, D): the sent sender blocks, in logical order
        src = torch.from_numpy(staging).view(layout.torch_dtype).view(shape)
    if storage.device.type != "cpu":
        src = src.to(storage.device)
    dst = [None if j in reused else block for j, block in enumerate(dst_blocks)]
    reblock_copy(storage.data, dst, src, src_index, num_tokens)
    if storage.device.type == "cuda":
        torch.cuda.synchronize(storage.device)
