"""Paged KV cache core shared by every worker: the block-major storage tensor (`storage`), the
block allocator with ref counts, a two-queue free list and prefix hashes (`allocator`), and the
manager that owns per-sequence block tables (`table`), prefix matching, copy-on-write, fork and
swap (`manager`, with the swap copies in `swap` and the table check in `integrity`). It knows
nothing of requests, models, workers or transports. The allocator-policy simulator of the second
seed, built on the same allocator, lives in `allocsim/`.
"""

from kvcache.allocator import BlockAllocator, IntegrityError, hash_block
from kvcache.manager import KVCacheManager
from kvcache.storage import KVLayout, KVStorage
from kvcache.table import BlockTable, blocks_for

__all__ = ["BlockAllocator", "IntegrityError", "hash_block", "BlockTable", "KVCacheManager",
           "blocks_for", "KVLayout", "KVStorage"]
