"""Block arithmetic shared by export, import and dedupe: prefix hashes of a token list at any
block size (the same chain as `KVCacheManager.prefix_hashes`, so sender and receiver agree), and
which sender blocks can be skipped because the receiver already holds every token in them.
"""

from __future__ import annotations

import numpy as np

from kvcache.allocator import ROOT_HASH, hash_block
from kvcache.manager import blocks_for


def prefix_hashes_at(token_ids, block_size: int, extra_key: str | None = None) -> list[int]:
    """Chained hashes of every full block of `token_ids` in blocks of `block_size`, computed with
    `kvcache.hash_block` itself (so the encoding can never drift) over int64 array slices."""
    n = len(token_ids) // block_size
    arr, out, parent = np.asarray(token_ids[:n * block_size], dtype=np.int64), [], ROOT_HASH
    for i in range(n):
        parent = hash_block(parent, arr[i * block_size:(i + 1) * block_size], extra_key)
        out.append(parent)
    return out


def skipped_blocks(num_tokens: int, block_size: int, reuse: set[int], reuse_block_size: int) -> list[bool]:
    """For each sender block: True when every token in it lies in a reused receiver block."""
    out = []
    for s in range(blocks_for(num_tokens, block_size)):
        lo, hi = s * block_size, min((s + 1) * block_size, num_tokens)
        out.append(bool(reuse) and all(j in reuse for j in range(lo // reuse_block_size,
                                                                   (hi - 1) // reuse_block_size + 1)))
    return out
