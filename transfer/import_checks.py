"""The read-only checks an import makes before it takes a single receiver block.

`check_manifest` validates a manifest against the receiver's storage: fingerprint (per the
connection's `CompatPlan`, or a fresh compatibility check), frame sizes (in sender blocks, or in
receiver blocks when the sender re-blocked), prefix hashes against the token ids, and that the
frames cover exactly the sender blocks the receiver lacks. `check_reuse` then looks up the
prefix blocks the manifest reuses and counts the fresh blocks the import needs against what the
pool has available; `cached_prefix` finds the prefix this receiver holds already when the sender
sent everything (a small transfer skips the dedupe query). Both raise a typed `TransferError`
and change nothing; `importer.ImportSession` reserves the blocks only after both passed.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.allocator import BlockAllocator
from kvcache.storage import KVStorage
from kvcache.table import blocks_for
from transfer.blocks import prefix_hashes_at, skipped_blocks
from transfer.errors import DedupeMiss, FingerprintMismatch, MalformedMessage, PoolFull
from transfer.reblock import CompatPlan, check_compatible
from transfer.wire_messages import Manifest


@dataclass(frozen=True)
class CheckedManifest:
    """What `check_manifest` worked out about a valid manifest.

    plan: the layout agreement (sender and receiver block sizes, whether to re-block).
    frame_block_size / frame_block_bytes: tokens and bytes of one block as the frames carry it
      (the sender's block, or the receiver's when the sender re-blocked).
    sender_hashes: prefix hashes of the sequence's full blocks at the sender's block size.
    sent: per frame-sized logical block, whether a frame carries it (False: the receiver reuses it).
    """

    plan: CompatPlan
    frame_block_size: int
    frame_block_bytes: int
    sender_hashes: list[int]
    sent: list[bool]

    @property
    def direct(self) -> bool:
        """The frames carry receiver-sized blocks: they land straight in the reserved blocks."""
        return self.frame_block_size == self.plan.dst_block_size


def check_manifest(manifest: Manifest, storage: KVStorage | None, block_size: int,
                   plan: CompatPlan | None) -> CheckedManifest:
    """Validate `manifest` for a receiver with `storage` and `block_size` (see the module doc)."""
    if storage is None:
        raise ValueError("import needs a manager with KV storage")
    if plan is None:
        plan = check_compatible(manifest.fingerprint, storage.layout.fingerprint())
    elif manifest.fingerprint != plan.sender_fingerprint:
        raise FingerprintMismatch("manifest fingerprint differs from the one agreed at the handshake")
    if plan.dst_block_size != block_size:
        raise FingerprintMismatch("the connection's plan was agreed for another block size")
    sender_size, receiver_size = plan.src_block_size, plan.dst_block_size
    if manifest.frame_block_size not in (0, receiver_size):
        raise MalformedMessage(f"frames re-blocked to {manifest.frame_block_size} tokens, "
                               f"receiver uses {receiver_size}")
    frame_size = manifest.frame_block_size or sender_size
    frame_block_bytes = storage.layout.token_bytes * frame_size
    for i, frame in enumerate(manifest.frames):
        if frame.nbytes != frame.num_blocks * frame_block_bytes:
            raise MalformedMessage(f"frame {i}: {frame.nbytes} bytes for {frame.num_blocks} blocks "
                                   f"of {frame_block_bytes}")
    num_tokens = manifest.num_tokens
    sender_hashes = prefix_hashes_at(manifest.state.token_ids[:num_tokens], sender_size, manifest.extra_key)
    if list(manifest.block_hashes) != sender_hashes:
        raise MalformedMessage("block hashes do not match the token ids")
    if manifest.reuse and manifest.reuse_block_size != receiver_size:
        raise MalformedMessage(f"reuse given in blocks of {manifest.reuse_block_size}, "
                               f"receiver uses {receiver_size}")
    sent = [False] * blocks_for(num_tokens, frame_size)
    for frame in manifest.frames:
        sent[frame.first_block:frame.first_block + frame.num_blocks] = [True] * frame.num_blocks
    skipped = skipped_blocks(num_tokens, frame_size, set(manifest.reuse), receiver_size or 1)
    if sent != [not s for s in skipped]:
        raise MalformedMessage("frames do not cover exactly the blocks the receiver lacks")
    return CheckedManifest(plan, frame_size, frame_block_bytes, sender_hashes, sent)


def check_reuse(allocator: BlockAllocator, manifest: Manifest,
                checked: CheckedManifest) -> tuple[list[int], int]:
    """(hashes of the reused receiver blocks, fresh blocks needed) for a checked manifest.

    Raises DedupeMiss when a block the receiver reported holding has left the cache since, and
    PoolFull when the fresh blocks plus the cached ones to revive exceed what is available.
    """
    receiver_size = checked.plan.dst_block_size
    reuse_hashes = []
    if manifest.reuse:
        hashes = _receiver_hashes(manifest, checked)
        reuse_hashes = [hashes[j] for j in manifest.reuse]
    revived = 0
    for block_hash in reuse_hashes:
        block = allocator.lookup(block_hash)
        if block is None:
            raise DedupeMiss("a block the receiver reported holding is no longer cached")
        revived += allocator.ref_count(block) == 0
    need = blocks_for(manifest.num_tokens, receiver_size) - len(reuse_hashes)
    if need + revived > allocator.num_available:
        raise PoolFull(f"need {need + revived} blocks, {allocator.num_available} available")
    return reuse_hashes, need


def cached_prefix(allocator: BlockAllocator, manifest: Manifest, checked: CheckedManifest) -> list[int]:
    """Hashes of the longest run of leading receiver blocks already in this receiver's prefix
    cache, for a manifest that reuses nothing (its sender skipped the dedupe query). The import
    then shares those blocks, as a queried one would, and discards their bytes."""
    if manifest.reuse:
        return []
    out = []
    for block_hash in _receiver_hashes(manifest, checked):
        if allocator.lookup(block_hash) is None:
            break
        out.append(block_hash)
    return out


def _receiver_hashes(manifest: Manifest, checked: CheckedManifest) -> list[int]:
    """Prefix hashes of the sequence's full blocks at the receiver's block size."""
    if not checked.plan.reblock:
        return checked.sender_hashes
    return prefix_hashes_at(manifest.state.token_ids[:manifest.num_tokens], checked.plan.dst_block_size,
                            manifest.extra_key)
