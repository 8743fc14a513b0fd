"""Import: validate a manifest, reserve blocks, land the payload in them, verify, then commit.

`ImportSession` is the all-or-nothing unit both transports drive: its constructor validates the
manifest against the receiver (`import_checks`: fingerprint per the connection's `CompatPlan`,
frame sizes, prefix hashes against the token ids, dedupe coverage; then sequence id and epoch)
and only then reserves blocks (reused prefix blocks by `acquire_cached`, the rest by
`allocate_many`, all or nothing; a small payload sent without a dedupe query shares the prefix
blocks this receiver caches already, and their bytes land in staging and are dropped). Chunks
must arrive in order; `chunk_buffers` says where the next one goes (`import_segments`: views of
the reserved pool blocks when the layouts match, a host staging buffer when re-blocking or
dropping held blocks, a pinned ring slot for device pools), `chunk_done` verifies its size and
checksum, and `commit` builds the table with `KVCacheManager.adopt`. Any failure calls `abort`:
every reservation is released, the error is counted, and the receiver's pool is exactly as it
was. `import_sequence` drives a session over in-memory frames.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import numpy as np

from kvcache.manager import KVCacheManager
from kvcache.table import BlockTable, blocks_for
from transfer.checksum import checksum_parts, copy_hashed
from transfer.epochs import EpochGuard
from transfer.errors import (
    ChecksumError,
    FrameCountError,
    FrameSizeError,
    PoolFull,
    SequenceExists,
    TransferError,
)
from transfer.import_checks import cached_prefix, check_manifest, check_reuse
from transfer.import_segments import pool_segments, reblock_staged, slot_segments
from transfer.metrics import DEFAULT_METRICS, TransferMetrics
from transfer.reblock import CompatPlan
from transfer.schema import Limits
from transfer.staging import DeviceSink
from transfer.wire_codec import DEFAULT_LIMITS, decode_manifest
from transfer.wire_messages import DecodeState, Manifest


@dataclass
class ImportResult:
    """A committed import: the receiver's new table and what decode needs to continue."""

    seq_id: object
    request_id: str
    epoch: int
    table: BlockTable
    state: DecodeState
    new_blocks: int
    reused_blocks: int
    nbytes: int
    timings: dict = field(default_factory=dict)


class ImportSession:
    """One in-progress import into `manager`'s pool. Not thread-safe; use the owner's thread."""

    def __init__(self, manager: KVCacheManager, manifest: Manifest, plan: CompatPlan | None = None, *,
                 epochs: EpochGuard | None = None, metrics: TransferMetrics | None = None,
                 stage: bool = False, make_room=None, local_dedupe_bytes: int = 256 << 10,
                 clock=time.monotonic):
        """clock: the time its idle and age bounds are measured in (a virtual one in `dst`)."""
        t0 = time.perf_counter()
        self.clock = clock
        self.local_dedupe_bytes = local_dedupe_bytes  # reuse cached blocks of an unqueried payload this small
        self.make_room = make_room  # admission.make_room: asked once for room when the pool is short
        self.manager, self.manifest, self.metrics = manager, manifest, metrics or DEFAULT_METRICS
        self.epochs, self.seq_id = epochs, manifest.request_id
        self._allocated: list[int] = []
        self._acquired: list[int] = []
        self._claimed = self._done = False
        self.sink = self.staging = None
        with self.aborting():
            self._validate(plan)
            self._reserve()
            self._setup_targets(stage)
        self._next = (0, 0)
        self.nbytes = 0
        self.timings = {"prepare_ms": (time.perf_counter() - t0) * 1e3}
        self.started = self.last_activity = clock()

    @contextlib.contextmanager
    def aborting(self):
        """Any failure inside aborts the session (a TransferError counted), then propagates."""
        try:
            yield
        except TransferError as e:
            self.abort(e)
            raise
        except BaseException:
            self.abort()
            raise

    # ---- validation and reservation -----------------------------------------------------
    def _validate(self, plan: CompatPlan | None) -> None:
        manifest = self.manifest
        self.checked = check_manifest(manifest, self.manager.storage, self.manager.block_size, plan)
        self.plan = self.checked.plan
        if self.seq_id in self.manager.tables:
            raise SequenceExists(f"sequence {self.seq_id!r} already exists on the receiver")
        if self.epochs is not None:
            self.epochs.begin(manifest.request_id, manifest.epoch)
            self._claimed = True

    def _reserve(self) -> None:
        manifest, allocator = self.manifest, self.manager.allocator
        try:
            reuse_hashes, need = check_reuse(allocator, manifest, self.checked)
        except PoolFull:
            if self.make_room is None:
                raise
            self.make_room(blocks_for(manifest.num_tokens, self.plan.dst_block_size) + 1)
            reuse_hashes, need = check_reuse(allocator, manifest, self.checked)  # PoolFull if still short
        reuse_at = list(manifest.reuse)
        if not reuse_at and manifest.payload_bytes <= self.local_dedupe_bytes:
            reuse_hashes = cached_prefix(allocator, manifest, self.checked)  # its bytes are discarded
            reuse_at, need = list(range(len(reuse_hashes))), need - len(reuse_hashes)
        # NOTE: each list is stored as soon as it is taken: `abort` releases exactly these two.
        self._acquired = [allocator.acquire_cached(h) for h in reuse_hashes]  # type: ignore[misc]
        self._allocated = allocator.allocate_many(need) or []
        fresh = iter(self._allocated)
        reuse = dict(zip(reuse_at, self._acquired))
        num_blocks = blocks_for(manifest.num_tokens, self.plan.dst_block_size)
        self.dst_blocks = [reuse[j] if j in reuse else next(fresh) for j in range(num_blocks)]
        self.reused = set(reuse_at)
        self.discard = bool(reuse_at) and not manifest.reuse  # sent bytes for blocks held already

    def _setup_targets(self, stage: bool) -> None:
        storage = self.manager.storage
        if not self.checked.direct or self.discard:  # staged; at commit only the fresh blocks are written
            self.staging = np.empty(self.manifest.payload_bytes, dtype=np.uint8)
            offsets = np.cumsum([0] + [frame.nbytes for frame in self.manifest.frames])
            self.frame_offset = [int(o) for o in offsets]
        elif storage.device.type != "cpu" or stage:
            self.sink = DeviceSink(storage.data, self.manifest.chunk_bytes)
        else:
            self.pool = storage.block_bytes_view(0, storage.num_blocks)

    # ---- chunks ---------------------------------------------------------------------------
    def next_chunk(self) -> tuple[int, int, int] | None:
        """(frame, chunk, nbytes) expected next, or None when every chunk has arrived."""
        frame, chunk = self._next
        if frame >= len(self.manifest.frames):
            return None
        chunk_bytes = self.manifest.chunk_bytes
        return frame, chunk, min(chunk_bytes, self.manifest.frames[frame].nbytes - chunk * chunk_bytes)

    def chunk_buffers(self, frame: int, chunk: int) -> list[memoryview]:
        """Writable views where chunk (frame, chunk) goes, in order; it must be the next expected one."""
        expected = self.next_chunk()
        if expected is None or expected[:2] != (frame, chunk):
            want = expected[:2] if expected else "none (extra chunk)"
            raise FrameCountError(f"chunk ({frame}, {chunk}) arrived, expected {want}")
        nbytes = expected[2]
        if self.staging is not None:
            start = self.frame_offset[frame] + chunk * self.manifest.chunk_bytes
            return [memoryview(self.staging[start:start + nbytes])]
        if self.sink is not None:
            self._slot = self.sink.slot()
            return [memoryview(self._slot.host[:nbytes].numpy())]
        return [self.pool[offset:offset + length] for offset, length in self._segments(frame, chunk)]

    def direct_targets(self) -> list[tuple[int, int, int, list[memoryview]]] | None:
        """(frame, chunk, nbytes, pool views) of every chunk still expected, when each lands straight
        in the reserved blocks, so a payload can be read in one go (`transfer.pull`); None when the
        chunks go through staging or a device ring (one buffer at a time, via `chunk_buffers`)."""
        if self.staging is not None or self.sink is not None:
            return None
        m, out = self.manifest, []
        f0, c0 = self._next
        for f in range(f0, len(m.frames)):
            desc = m.frames[f]
            for c in range(c0 if f == f0 else 0, desc.num_chunks(m.chunk_bytes)):
                segs = self._segments(f, c)
                out.append((f, c, sum(n for _, n in segs), [self.pool[o:o + n] for o, n in segs]))
        return out

    def _segments(self, frame: int, chunk: int) -> list[tuple[int, int]]:
        return pool_segments(self.manifest.frames[frame], chunk, self.manifest.chunk_bytes,
                             self.checked.frame_block_bytes, self.dst_blocks)

    def chunk_done(self, frame: int, chunk: int, nbytes: int, bufs: list,
                   inline_checksum: int | None = None, landed_checksum: int | None = None) -> None:
        """Check the size and checksum of the chunk just written into `bufs` (`landed_checksum`:
        their xxh3-64 when the landing code hashed them as they landed, `transfer.pull`)."""
        manifest = self.manifest
        _, _, want = self.next_chunk()  # type: ignore[misc]
        if nbytes != want:
            raise FrameSizeError(f"chunk ({frame}, {chunk}): {nbytes} bytes, expected {want}")
        inline = manifest.checksum_mode == "inline"
        expect = inline_checksum if inline else manifest.frames[frame].checksums[chunk]
        got = checksum_parts(bufs) if landed_checksum is None else landed_checksum
        if expect is None or got != expect:
            raise ChecksumError(f"chunk ({frame}, {chunk}) of request {manifest.request_id!r} "
                                "failed its checksum")
        if self.sink is not None:
            self.sink.scatter(self._slot, slot_segments(self._segments(frame, chunk)))
        self.nbytes += nbytes
        self.last_activity = self.clock()
        last = chunk + 1 >= manifest.frames[frame].num_chunks(manifest.chunk_bytes)
        self._next = (frame + 1, 0) if last else (frame, chunk + 1)

    # ---- commit / abort -------------------------------------------------------------------
    def commit(self) -> ImportResult:
        """Make the import visible (adopt the blocks) once every chunk has arrived and verified."""
        t0 = time.perf_counter()
        manifest = self.manifest
        with self.aborting():
            if self._done:
                raise FrameCountError("session already finished")
            if self.next_chunk() is not None:
                raise FrameCountError(f"transfer ended early: chunk {self._next} missing")
            if self.sink is not None:
                self.sink.synchronize()
            if self.staging is not None:
                reblock_staged(self.manager.storage, self.staging, self.checked.sent, self.dst_blocks,
                               self.reused, self.checked.frame_block_size, manifest.num_tokens)
            self.manager.adopt(self.seq_id, self.dst_blocks, manifest.state.token_ids[:manifest.num_tokens],
                               manifest.extra_key)
        self._done = True
        if self._claimed:
            self.epochs.commit(manifest.request_id, manifest.epoch)  # type: ignore[union-attr]
        self.timings["commit_ms"] = (time.perf_counter() - t0) * 1e3
        self.metrics.add("imports")
        self.metrics.add("bytes_received", self.nbytes)
        self.metrics.add("blocks_reused", len(self._acquired))
        return ImportResult(self.seq_id, manifest.request_id, manifest.epoch, self.manager.table(self.seq_id),
                            manifest.state, len(self._allocated), len(self._acquired), self.nbytes,
                            dict(self.timings))

    def abort(self, err: TransferError | None = None) -> None:
        """Release every reservation (idempotent) and count the error."""
        if self._done:
            return
        self._done = True
        if self.sink is not None:
            self.sink.synchronize()  # NOTE: before the frees below: no copy may land in a freed block
        allocator = self.manager.allocator
        allocator.free_many(self._allocated[::-1])
        allocator.free_many(self._acquired[::-1])
        self._allocated, self._acquired = [], []
        if self._claimed:
            self.epochs.abort(self.manifest.request_id, self.manifest.epoch)  # type: ignore[union-attr]
        if err is not None:
            self.metrics.record_error(err)


def import_sequence(manager: KVCacheManager, manifest, frames, *, epochs: EpochGuard | None = None,
                    metrics: TransferMetrics | None = None, limits: Limits = DEFAULT_LIMITS,
                    stage: bool = False, make_room=None) -> ImportResult:
    """Import from a manifest (typed or msgpack bytes) and a list of frame buffers, in process.

    Raises a TransferError (counted in `metrics`) and leaves the pool unchanged on any failure.
    """
    metrics = metrics or DEFAULT_METRICS
    try:
        manifest = manifest if isinstance(manifest, Manifest) else decode_manifest(manifest, limits)
    except TransferError as e:
        metrics.record_error(e)
        raise
    session = ImportSession(manager, manifest, epochs=epochs, metrics=metrics, stage=stage,
                            make_room=make_room)
    chunk_bytes = manifest.chunk_bytes
    with session.aborting():
        if len(frames) != len(manifest.frames):
            raise FrameCountError(f"{len(frames)} frames for a manifest of {len(manifest.frames)}")
        for frame, buf in enumerate(frames):
            view = memoryview(buf).cast("B")
            desc = manifest.frames[frame]
            if view.nbytes != desc.nbytes:
                raise FrameSizeError(f"frame {frame}: {view.nbytes} bytes, manifest says {desc.nbytes}")
            for chunk in range(desc.num_chunks(chunk_bytes)):
                targets = session.chunk_buffers(frame, chunk)  # within the frame: its size was checked
                landed = copy_hashed(targets, view[chunk * chunk_bytes:])
                n = sum(t.nbytes for t in targets)
                session.chunk_done(frame, chunk, n, targets, landed_checksum=landed)
    return session.commit()
