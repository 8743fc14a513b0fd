"""Block arithmetic shared by export, import and dedupe: prefix hashes of a token list at any
block size (the same chain as `KVCacheManager.prefix_hashes`, so sender and receiver agree), and
which sender blocks can be skipped because the receiver already holds every token in them.
"""

from __future__ import annotations

import numpy as np

from kvcache.manager import blocks_for
from protocol.prefix_hash import hash_chain


def prefix_hashes_at(token_ids, block_size: int, extra_key: str | None = None) -> list[int]:
    """Chained hashes of every full block of `token_ids` in blocks of `block_size` (the one
    encoding of `protocol.prefix_hash`, so it can never drift)."""
    return hash_chain(token_ids, block_size, extra_key)


def skipped_blocks(num_tokens: int, block_size: int, reuse: set[int], reuse_block_size: int) -> list[bool]:
    """For each sender block: True when every token in it lies in a reused receiver block.
    Vectorised: a sender block is skipped when the count of reused receiver blocks over the
    range it spans (a prefix sum) equals the range's length."""
    nb = blocks_for(num_tokens, block_size)
    if not reuse or nb == 0:
        return [False] * nb
    R = reuse_block_size
    held = np.zeros(blocks_for(num_tokens, R), dtype=np.int64)  # (receiver blocks,)
    idx = np.fromiter((j for j in reuse if 0 <= j < held.size), dtype=np.int64)
    held[idx] = 1
    before = np.concatenate(([0], np.cumsum(held)))  # before[j]: reused receiver blocks < j
    lo = np.arange(nb, dtype=np.int64) * block_size  # (sender blocks,) first token
    hi = np.minimum(lo + block_size, num_tokens)     # one past the last token
    first, stop = lo // R, (hi - 1) // R + 1          # receiver blocks [first, stop) it spans
    return (before[stop] - before[first] == stop - first).tolist()
