"""The chained prefix hash of a full KV block, which every layer must compute identically: the
block allocator keys its prefix cache by it, migration dedupe and manifests carry it, and the
coordinator's prefix-aware router uses it to keep shared prompts on one worker. Torch-free.
"""

from __future__ import annotations

import numpy as np
import xxhash

ROOT_HASH = 0  # the parent hash of a sequence's first block


def hash_block(parent_hash: int, token_ids, extra_key: bytes | str | None = None) -> int:
    """Chained prefix hash of one full block: H(parent hash, the block's token ids, extra key).

    Stable across processes and machines (xxh3-64 over bytes), so two workers can compare hashes.
    The encoding is unambiguous: the token count and the extra key's presence and length are
    hashed too, so no (tokens, key) pair can collide with another by shifting bytes between them.
    """
    tokens = np.asarray(token_ids, dtype=np.int64).reshape(-1)  # (T,)
    h = xxhash.xxh3_64()
    h.update(int(parent_hash).to_bytes(8, "little", signed=False))
    h.update(len(tokens).to_bytes(8, "little"))
    h.update(tokens.tobytes())
    if extra_key is not None:
        key = extra_key.encode() if isinstance(extra_key, str) else bytes(extra_key)
        h.update(b"\x01" + len(key).to_bytes(8, "little") + key)
    return h.intdigest()
