"""One sequence's block table: its physical blocks in logical order, its token ids, how many of
them have K/V written, and the prefix hashes of its sealed (full, computed) blocks, plus the
slot formula and the ceiling division `blocks_for` that sizes every table. Plain data; the rules
that keep tables consistent with the allocator live in `kvcache.manager`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens (ceiling division)."""
    return -(-num_tokens // block_size)


@dataclass
class BlockTable:
    """One sequence's view of the cache.

    blocks: physical block ids in logical order (host ids while swapped out).
    token_ids: every token that has a slot (computed or about to be).
    num_computed: tokens whose K/V are written into their slots.
    block_hashes: prefix hashes of the leading full, computed blocks.
    """

    blocks: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_hashes: list[int] = field(default_factory=list)
    extra_key: str | None = None
    swapped: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def slot(self, token: int, block_size: int) -> int:
        """Physical slot of logical token `token`: table[token // B] * B + token % B."""
        return self.blocks[token // block_size] * block_size + token % block_size

    def tail_fill(self, block_size: int) -> int:
        """Tokens in the last block (block_size when it is full, 0 when there are no blocks)."""
        if not self.blocks:
            return 0
        return self.num_tokens - (len(self.blocks) - 1) * block_size
