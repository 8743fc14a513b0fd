"""Block arithmetic shared by export, import and dedupe: prefix hashes of a token list at any
block size (the same chain as `KVCacheManager.prefix_hashes`, so sender and receiver agree), and
which sender blocks can be skipped because the receiver already holds every token in them.
"""

from __future__ import annotations

from kvcache.manager import blocks_for
from protocol.prefix_hash import hash_chain


def prefix_hashes_at(token_ids, block_size: int, extra_key: str | None = None) -> list[int]:
    """Chained hashes of every full block of `token_ids` in blocks of `block_size` (the one
    encoding of `protocol.prefix_hash`, so it can never drift)."""
    return hash_chain(token_ids, block_size, extra_key)


def skipped_blocks(num_tokens: int, block_size: int, reuse: set[int], reuse_block_size: int) -> list[bool]:
    """For each sender block: True when every token in it lies in a reused receiver block."""
    out = []
    for s in range(blocks_for(num_tokens, block_size)):
        lo, hi = s * block_size, min((s + 1) * block_size, num_tokens)
        out.append(bool(reuse) and all(j in reuse for j in range(lo // reuse_block_size,
                                                                   (hi - 1) // reuse_block_size + 1)))
    return out
