"""Export: one sequence's block table -> manifest + payload frames, straight from pool memory.

Runs of blocks that are adjacent both logically and physically coalesce into one frame; on a CPU
pool a frame is a memoryview over the pool (no gather copy). A device pool is read through
pinned host staging (`transfer.staging`). For a receiver with another block size the payload is
re-blocked here into its blocks (`export_reblock`: one gather copy, no lease needed). The
exported blocks get one extra reference (a lease) until `release()`: the transport calls it on
the receiver's ack or nack, and a `LeaseTable` calls it when the lease expires, so a sequence
freed mid-transfer cannot have its blocks reused under the wire. Call `release` on the thread
that owns the manager (the allocator is not thread-safe).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from kvcache.manager import KVCacheManager, blocks_for
from transfer.blocks import skipped_blocks
from transfer.checksum import checksum_many
from transfer.export_reblock import block_runs, gather_reblocked
from transfer.schema import Limits
from transfer.staging import DeviceChunks, stage_all
from transfer.wire_codec import DEFAULT_LIMITS
from transfer.wire_messages import DecodeState, FrameDesc, Manifest, validate_sampling


@dataclass(frozen=True)
class ExportConfig:
    """How a sequence is cut into frames and chunks.

    chunk_bytes: wire message size and checksum unit (a frame is sent as ceil(nbytes/chunk) chunks).
    max_frame_bytes: cap on one coalesced frame.
    checksum_mode: "manifest" computes every chunk's checksum now and puts it in the manifest;
      "inline" leaves them to the transport, which hashes each chunk as it streams it.
    lease_s: how long the exported blocks stay referenced without an ack.
    lease: take a reference on every exported block until the ack (False: the caller keeps the
      sequence's blocks allocated until the send returns, and no allocator call is made, so an
      export can be built off the thread that owns the pool).
    stage: force the staged (device-style) read path even for a CPU pool (tests use it).
    checksum_threads: threads that hash the chunks in "manifest" mode (`checksum_many`).
    """

    chunk_bytes: int = 2 << 20
    max_frame_bytes: int = 1 << 30
    checksum_mode: str = "manifest"
    lease_s: float = 60.0
    lease: bool = True
    stage: bool = False
    checksum_threads: int = 1


class ExportedSequence:
    """Manifest + frames of one transfer, holding a lease on the sent blocks until `release()`."""

    def __init__(self, manifest: Manifest, frames: list | None, chunk_source, allocator, held: list[int],
                 lease_s: float):
        self.manifest = manifest
        self.frames = frames  # host buffers (one per frame), or None when streamed from a device
        self._chunk_source = chunk_source
        self._allocator = allocator
        self.held_blocks = held
        self.deadline = time.monotonic() + lease_s
        self.released = False

    def chunks(self):
        """(frame index, chunk index, memoryview, slot or None) in wire order."""
        if self.frames is None:
            yield from self._chunk_source()
            return
        cb = self.manifest.chunk_bytes
        for f, (desc, buf) in enumerate(zip(self.manifest.frames, self.frames)):
            for c in range(desc.num_chunks(cb)):
                yield f, c, buf[c * cb:(c + 1) * cb], None

    def release(self) -> None:
        """Drop the lease's references (idempotent)."""
        if not self.released:
            self.released = True
            self._allocator.free_many(self.held_blocks[::-1])

    def extra_refs(self) -> dict[int, int]:
        """Block -> references this lease holds (for `KVCacheManager.check_integrity`)."""
        out: dict[int, int] = {}
        if not self.released:
            for b in self.held_blocks:
                out[b] = out.get(b, 0) + 1
        return out


def export_sequence(manager: KVCacheManager, seq_id, request_id: str, epoch: int,
                    state: DecodeState | dict | None = None, *, reuse=(), reuse_block_size: int = 0,
                    config: ExportConfig | None = None, limits: Limits = DEFAULT_LIMITS,
                    frame_block_size: int = 0) -> ExportedSequence:
    """Build the manifest and frames for the computed tokens of `seq_id`.

    state: the decode state (default: the table's token ids, default sampling). Its token ids
    must start with the tokens that have KV. reuse / reuse_block_size: receiver logical blocks
    the receiver holds (from a dedupe query) and its block size; the sender blocks entirely
    inside them are not sent. frame_block_size: the receiver's block size when it differs from
    this pool's: the payload is re-blocked here (`export_reblock`) into receiver blocks, and
    the reused ones are not sent. Raises ValueError on misuse (unknown or swapped sequence, no KV).
    """
    config = config or ExportConfig()
    storage = manager.storage
    if storage is None:
        raise ValueError("export needs a manager with KV storage")
    t = manager.table(seq_id)
    if t.swapped:
        raise ValueError(f"sequence {seq_id!r} is swapped out; swap it in before exporting")
    n, B = t.num_computed, manager.block_size
    if n < 1:
        raise ValueError(f"sequence {seq_id!r} has no computed KV to export")
    if state is None:
        state = DecodeState(token_ids=list(t.token_ids))
    elif isinstance(state, dict):
        state = DecodeState(**state)
    if list(state.token_ids[:n]) != t.token_ids[:n]:
        raise ValueError("state.token_ids must start with the sequence's tokens that have KV")
    sampling = validate_sampling(dict(state.sampling), limits)
    state = DecodeState(list(state.token_ids), sampling, state.num_generated)
    if config.checksum_mode not in ("manifest", "inline"):
        raise ValueError(f"unknown checksum_mode {config.checksum_mode!r}")
    if not limits.min_chunk_bytes <= config.chunk_bytes <= limits.max_chunk_bytes:
        raise ValueError(f"chunk_bytes {config.chunk_bytes} outside the limits")
    if not 0 <= state.num_generated <= len(state.token_ids):
        raise ValueError(f"num_generated {state.num_generated} outside 0..{len(state.token_ids)}")
    reuse = sorted({int(j) for j in reuse})
    if reuse and (reuse_block_size < 1 or reuse[0] < 0 or (reuse[-1] + 1) * reuse_block_size > n):
        raise ValueError("reuse must name full receiver blocks and come with the receiver's block size")
    nb = blocks_for(n, B)
    blocks = t.blocks[:nb]
    hashes = t.block_hashes[:n // B] if len(t.block_hashes) >= n // B else \
        manager.prefix_hashes(t.token_ids[:n], t.extra_key)
    reblock = frame_block_size not in (0, B)
    if reblock and reuse and reuse_block_size != frame_block_size:
        raise ValueError("reuse must be given in the receiver's blocks, the frames' block size")
    manifest = Manifest(  # its frames follow
        request_id=str(request_id), epoch=int(epoch), fingerprint=storage.layout.fingerprint(),
        num_tokens=n, block_tokens=tuple([B] * (nb - 1) + [n - (nb - 1) * B]),
        block_hashes=tuple(hashes), frames=(), chunk_bytes=config.chunk_bytes, state=state,
        checksum_mode=config.checksum_mode, extra_key=t.extra_key, reuse=tuple(reuse),
        reuse_block_size=reuse_block_size if reuse else 0,
        frame_block_size=frame_block_size if reblock else 0)
    if reblock:
        return _reblocked(manager, manifest, blocks, config)
    skip = skipped_blocks(n, B, set(reuse), reuse_block_size)
    bb = storage.layout.block_bytes
    runs = block_runs([i for i in range(nb) if not skip[i]], max(1, config.max_frame_bytes // bb),
                      lambda i: blocks[i - 1] + 1 == blocks[i])  # physically adjacent too
    held = [blocks[i] for first, count in runs for i in range(first, first + count)] if config.lease else []
    for b in held:
        manager.allocator.incref(b)
    try:
        ranges = [(blocks[first] * bb, count * bb) for first, count in runs]
        device = storage.device.type != "cpu" or config.stage
        frames, source = None, None
        if not device:
            frames = [storage.block_bytes_view(blocks[first], count) for first, count in runs]
        elif config.checksum_mode == "manifest":
            _, frames = stage_all(storage.data, ranges, config.chunk_bytes)
        else:
            def source():
                yield from DeviceChunks(storage.data, ranges, config.chunk_bytes)
        manifest = dataclasses.replace(manifest, frames=_descs(runs, frames, bb, config))
    except BaseException:
        manager.allocator.free_many(held[::-1])
        raise
    return ExportedSequence(manifest, frames, source, manager.allocator, held, config.lease_s)


def _reblocked(manager: KVCacheManager, manifest: Manifest, blocks: list[int],
               config: ExportConfig) -> ExportedSequence:
    """The export of `manifest` (frames still empty) with its payload re-blocked into
    manifest.frame_block_size-token blocks: one host copy, so no lease on the pool is taken."""
    R, n = manifest.frame_block_size, manifest.num_tokens
    reused = set(manifest.reuse)
    sent = [j for j in range(blocks_for(n, R)) if j not in reused]
    buf = gather_reblocked(manager.storage, blocks, n, R, sent).view(-1).view(torch.uint8).numpy()
    rbb = manager.storage.layout.token_bytes * R
    frames, runs, pos = [], block_runs(sent, max(1, config.max_frame_bytes // rbb)), 0
    for _, count in runs:
        frames.append(memoryview(buf[pos:pos + count * rbb]))
        pos += count * rbb
    manifest = dataclasses.replace(manifest, frames=_descs(runs, frames, rbb, config))
    return ExportedSequence(manifest, frames, None, manager.allocator, [], config.lease_s)


def _descs(runs, frames, block_bytes: int, config: ExportConfig) -> tuple[FrameDesc, ...]:
    """The frame descriptors of `runs` ([first logical block, count]), checksummed in "manifest" mode."""
    sums = _chunk_sums(frames, config) if config.checksum_mode == "manifest" else [None] * len(runs)
    return tuple(FrameDesc(first, count, count * block_bytes, s) for (first, count), s in zip(runs, sums))


def _chunk_sums(frames, config: ExportConfig) -> list[tuple[int, ...]]:
    """Each frame's chunk checksums, every chunk of every frame hashed in one `checksum_many`."""
    cb = config.chunk_bytes
    cuts = [[(k, c) for c in range(0, memoryview(f).nbytes, cb)] for k, f in enumerate(frames)]
    flat = checksum_many([[frames[k][c:c + cb]] for frame in cuts for k, c in frame], config.checksum_threads)
    out, at = [], 0
    for frame in cuts:
        out.append(tuple(flat[at:at + len(frame)]))
        at += len(frame)
    return out
