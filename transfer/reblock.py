"""Layout compatibility and re-blocking between pools with different block sizes.

`check_compatible` runs once per connection (the handshake): layers, KV heads, head dim, dtype
and layout name must match; block sizes may differ, and the returned `CompatPlan` says whether
imports on this connection re-block. `reblock_copy` moves tokens from sender-sized blocks (a
staging tensor) into receiver-sized pool blocks, one strided copy per overlapping
(sender block, receiver block) pair, so any pair of sizes works (16->32, 32->16, 16->8, 16->24).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from transfer.errors import FingerprintMismatch
from transfer.wire_messages import FINGERPRINT_KEYS


@dataclass(frozen=True)
class CompatPlan:
    """Agreed once per connection.

    sender_fingerprint: the exact fingerprint every manifest on this connection must carry.
    src_block_size / dst_block_size: sender and receiver tokens per block.
    """

    sender_fingerprint: dict
    src_block_size: int
    dst_block_size: int

    @property
    def reblock(self) -> bool:
        return self.src_block_size != self.dst_block_size


def check_compatible(sender_fp: dict, receiver_fp: dict) -> CompatPlan:
    """Raise FingerprintMismatch naming every differing field (block size aside)."""
    diffs = [f"{k}: sender {sender_fp.get(k)!r} vs receiver {receiver_fp.get(k)!r}"
             for k in FINGERPRINT_KEYS if k != "block_size" and sender_fp.get(k) != receiver_fp.get(k)]
    if diffs:
        raise FingerprintMismatch("incompatible KV layouts: " + "; ".join(diffs))
    return CompatPlan(dict(sender_fp), int(sender_fp["block_size"]), int(receiver_fp["block_size"]))


def reblock_copy(dst: torch.Tensor, dst_blocks: list[int | None], src: torch.Tensor,
                 src_index: list[int | None], num_tokens: int) -> None:
    """Copy every token of the receiver's new blocks from sender blocks.

    dst: the receiver pool, (N, L, 2, Br, H, D). dst_blocks[j]: physical block of receiver
    logical block j, or None when j is reused (already holds its tokens).
    src: staged sender blocks, (S, L, 2, Bs, H, D) on any device. src_index[i]: row of sender
    logical block i in `src`, or None when it was not sent (the caller checked coverage).
    """
    Br, Bs = dst.shape[3], src.shape[3]
    for j, rb in enumerate(dst_blocks):
        if rb is None:
            continue
        lo, hi = j * Br, min((j + 1) * Br, num_tokens)
        t = lo
        while t < hi:
            s = t // Bs
            end = min(hi, (s + 1) * Bs)
            row = src_index[s]
            if row is None:
                raise ValueError(f"sender block {s} is needed for receiver block {j} but was not sent")
            # (L, 2, n, H, D) <- (L, 2, n, H, D)
            dst[rb, :, :, t - lo:end - lo].copy_(src[row, :, :, t - s * Bs:end - s * Bs], non_blocking=True)
            t = end
