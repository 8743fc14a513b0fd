"""Import: validate a manifest, reserve blocks, land the payload in them, verify, then commit.

`ImportSession` is the all-or-nothing unit both transports drive: its constructor validates the
manifest against the receiver (fingerprint per the connection's `CompatPlan`, frame sizes,
prefix hashes against the token ids, dedupe coverage, epoch, sequence id) and only then reserves
blocks (reused prefix blocks by `acquire_cached`, the rest by `allocate_many`, all or nothing).
Chunks must arrive in order; `chunk_buffers` says where the next one goes (views of the reserved
pool blocks when the layouts match, a host staging buffer when re-blocking, a pinned ring slot
for device pools), `chunk_done` verifies its size and checksum, and `commit` builds the table with
`KVCacheManager.adopt`. Any failure calls `abort`: every reservation is released, the error is
counted, and the receiver's pool is exactly as it was.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kvcache.manager import BlockTable, KVCacheManager, blocks_for
from transfer.blocks import prefix_hashes_at, skipped_blocks
from transfer.checksum import checksum_parts
from transfer.codec import DEFAULT_LIMITS, decode_manifest
from transfer.epochs import EpochGuard
from transfer.errors import (
    ChecksumError,
    DedupeMiss,
    FingerprintMismatch,
    FrameCountError,
    FrameSizeError,
    MalformedMessage,
    PoolFull,
    SequenceExists,
    TransferError,
)
from transfer.messages import DecodeState, Manifest
from transfer.metrics import DEFAULT_METRICS, TransferMetrics
from transfer.reblock import CompatPlan, check_compatible, reblock_copy
from transfer.schema import Limits
from transfer.staging import DeviceSink


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
                 seq_id=None, epochs: EpochGuard | None = None, metrics: TransferMetrics | None = None,
                 stage: bool = False):
        t0 = time.perf_counter()
        self.manager, self.m, self.metrics = manager, manifest, metrics or DEFAULT_METRICS
        self.epochs, self.seq_id = epochs, manifest.request_id if seq_id is None else seq_id
        self._allocated: list[int] = []
        self._acquired: list[int] = []
        self._claimed = self._done = False
        self.sink = self.staging = None
        try:
            self._validate(plan)
            self._reserve()
            self._setup_targets(stage)
        except TransferError as e:
            self.abort(e)
            raise
        except BaseException:
            self.abort()
            raise
        self._next = (0, 0)
        self.nbytes = 0
        self.timings = {"prepare_ms": (time.perf_counter() - t0) * 1e3}
        self.last_activity = time.monotonic()

    # ---- validation and reservation -----------------------------------------------------
    def _validate(self, plan: CompatPlan | None) -> None:
        m, storage = self.m, self.manager.storage
        if storage is None:
            raise ValueError("import needs a manager with KV storage")
        if plan is None:
            plan = check_compatible(m.fingerprint, storage.layout.fingerprint())
        elif m.fingerprint != plan.sender_fingerprint:
            raise FingerprintMismatch("manifest fingerprint differs from the one agreed at the handshake")
        if plan.dst_block_size != self.manager.block_size:
            raise FingerprintMismatch("the connection's plan was agreed for another block size")
        self.plan, self.Bs, self.Br = plan, plan.src_block_size, plan.dst_block_size
        self.sbb = storage.layout.token_bytes * self.Bs  # bytes of one sender block
        for i, f in enumerate(m.frames):
            if f.nbytes != f.num_blocks * self.sbb:
                raise MalformedMessage(f"frame {i}: {f.nbytes} bytes for {f.num_blocks} blocks of {self.sbb}")
        n, kv_tokens = m.num_tokens, m.state.token_ids[:m.num_tokens]
        self.src_hashes = prefix_hashes_at(kv_tokens, self.Bs, m.extra_key)
        if list(m.block_hashes) != self.src_hashes:
            raise MalformedMessage("block hashes do not match the token ids")
        if m.reuse and m.reuse_block_size != self.Br:
            raise MalformedMessage(f"reuse given in blocks of {m.reuse_block_size}, receiver uses {self.Br}")
        sent = [False] * blocks_for(n, self.Bs)
        for f in m.frames:
            sent[f.first_block:f.first_block + f.num_blocks] = [True] * f.num_blocks
        expected = [not s for s in skipped_blocks(n, self.Bs, set(m.reuse), self.Br or 1)]
        if sent != expected:
            raise MalformedMessage("frames do not cover exactly the blocks the receiver lacks")
        self.sent = sent
        if self.seq_id in self.manager.tables:
            raise SequenceExists(f"sequence {self.seq_id!r} already exists on the receiver")
        if self.epochs is not None:
            self.epochs.begin(m.request_id, m.epoch)
            self._claimed = True

    def _reserve(self) -> None:
        m, alloc = self.m, self.manager.allocator
        n_recv = blocks_for(m.num_tokens, self.Br)
        reuse_hashes = []
        if m.reuse:
            hashes = self.src_hashes if self.Br == self.Bs else \
                prefix_hashes_at(m.state.token_ids[:m.num_tokens], self.Br, m.extra_key)
            reuse_hashes = [hashes[j] for j in m.reuse]
        revived = 0
        for h in reuse_hashes:
            b = alloc.lookup(h)
            if b is None:
                raise DedupeMiss("a block the receiver reported holding is no longer cached")
            revived += alloc.ref_count(b) == 0
        need = n_recv - len(reuse_hashes)
        if need + revived > alloc.num_available:
            raise PoolFull(f"need {need + revived} blocks, {alloc.num_available} available")
        self._acquired = [alloc.acquire_cached(h) for h in reuse_hashes]  # type: ignore[misc]
        self._allocated = alloc.allocate_many(need) or []
        new = iter(self._allocated)
        reuse = dict(zip(m.reuse, self._acquired))
        self.dst_blocks = [reuse[j] if j in reuse else next(new) for j in range(n_recv)]
        self.reused = set(m.reuse)

    def _setup_targets(self, stage: bool) -> None:
        storage = self.manager.storage
        if self.plan.reblock:
            self.staging = np.empty(self.m.payload_bytes, dtype=np.uint8)
            offs = np.cumsum([0] + [f.nbytes for f in self.m.frames])
            self.frame_offset = [int(o) for o in offs]
        elif storage.device.type != "cpu" or stage:
            self.sink = DeviceSink(storage.data, self.m.chunk_bytes)
        else:
            self.pool = storage.block_bytes_view(0, storage.num_blocks)

    # ---- chunks ---------------------------------------------------------------------------
    def next_chunk(self) -> tuple[int, int, int] | None:
        """(frame, chunk, nbytes) expected next, or None when every chunk has arrived."""
        f, c = self._next
        if f >= len(self.m.frames):
            return None
        d = self.m.frames[f]
        return f, c, min(self.m.chunk_bytes, d.nbytes - c * self.m.chunk_bytes)

    def _segments(self, f: int, c: int) -> list[tuple[int, int]]:
        """(pool byte offset, length) runs that chunk c of frame f lands in (same block size)."""
        d, cb, bb = self.m.frames[f], self.m.chunk_bytes, self.sbb
        pos, end, segs = c * cb, min((c + 1) * cb, d.nbytes), []
        while pos < end:
            off = pos % bb
            k = min(bb - off, end - pos)
            dst = self.dst_blocks[d.first_block + pos // bb] * bb + off
            if segs and segs[-1][0] + segs[-1][1] == dst:
                segs[-1] = (segs[-1][0], segs[-1][1] + k)
            else:
                segs.append((dst, k))
            pos += k
        return segs

    def chunk_buffers(self, f: int, c: int) -> list[memoryview]:
        """Writable views where chunk (f, c) goes, in order; it must be the next expected one."""
        nxt = self.next_chunk()
        if nxt is None or nxt[:2] != (f, c):
            want = nxt[:2] if nxt else "none (extra chunk)"
            raise FrameCountError(f"chunk ({f}, {c}) arrived, expected {want}")
        n = nxt[2]
        if self.staging is not None:
            o = self.frame_offset[f] + c * self.m.chunk_bytes
            return [memoryview(self.staging[o:o + n])]
        if self.sink is not None:
            self._slot = self.sink.slot()
            return [memoryview(self._slot.host[:n].numpy())]
        return [self.pool[o:o + k] for o, k in self._segments(f, c)]

    def chunk_done(self, f: int, c: int, nbytes: int, bufs: list, inline_checksum: int | None = None) -> None:
        """Check the size and checksum of the chunk just written into `bufs`."""
        _, _, want = self.next_chunk()  # type: ignore[misc]
        if nbytes != want:
            raise FrameSizeError(f"chunk ({f}, {c}): {nbytes} bytes, expected {want}")
        expect = inline_checksum if self.m.checksum_mode == "inline" else self.m.frames[f].checksums[c]
        if expect is None or checksum_parts(bufs) != expect:
            raise ChecksumError(f"chunk ({f}, {c}) of request {self.m.request_id!r} failed its checksum")
        if self.sink is not None:
            self.sink.scatter(self._slot, list(self._slot_segments(f, c)))
        self.nbytes += nbytes
        self.last_activity = time.monotonic()
        d = self.m.frames[f]
        self._next = (f, c + 1) if c + 1 < d.num_chunks(self.m.chunk_bytes) else (f + 1, 0)

    def _slot_segments(self, f: int, c: int):
        pos = 0
        for dst, k in self._segments(f, c):
            yield dst, pos, k
            pos += k

    # ---- commit / abort -------------------------------------------------------------------
    def commit(self) -> ImportResult:
        """Make the import visible (adopt the blocks) once every chunk has arrived and verified."""
        t0 = time.perf_counter()
        try:
            if self._done:
                raise FrameCountError("session already finished")
            if self.next_chunk() is not None:
                raise FrameCountError(f"transfer ended early: chunk {self._next} missing")
            if self.sink is not None:
                self.sink.synchronize()
            if self.staging is not None:
                self._reblock()
            m = self.m
            self.manager.adopt(self.seq_id, self.dst_blocks, m.state.token_ids[:m.num_tokens], m.extra_key)
        except TransferError as e:
            self.abort(e)
            raise
        except BaseException:
            self.abort()
            raise
        self._done = True
        if self._claimed:
            self.epochs.commit(m.request_id, m.epoch)  # type: ignore[union-attr]
        self.timings["commit_ms"] = (time.perf_counter() - t0) * 1e3
        self.metrics.add("imports")
        self.metrics.add("bytes_received", self.nbytes)
        self.metrics.add("blocks_reused", len(self._acquired))
        return ImportResult(self.seq_id, m.request_id, m.epoch, self.manager.table(self.seq_id), m.state,
                            len(self._allocated), len(self._acquired), self.nbytes, dict(self.timings))

    def _reblock(self) -> None:
        storage, m = self.manager.storage, self.m
        lay = storage.layout
        rows, src_index = 0, []
        for s in self.sent:
            src_index.append(rows if s else None)
            rows += s
        src = torch.from_numpy(self.staging).view(lay.torch_dtype)
        # (S, L, 2, Bs, H, D): the sent sender blocks, in logical order
        src = src.view(rows, lay.num_layers, 2, self.Bs, lay.num_kv_heads, lay.head_dim)
        if storage.device.type != "cpu":
            src = src.to(storage.device)
        dst = [None if j in self.reused else b for j, b in enumerate(self.dst_blocks)]
        reblock_copy(storage.data, dst, src, src_index, m.num_tokens)
        if storage.device.type == "cuda":
            torch.cuda.synchronize(storage.device)

    def abort(self, err: TransferError | None = None) -> None:
        """Release every reservation (idempotent) and count the error."""
        if self._done:
            return
        self._done = True
        if self.sink is not None:
            self.sink.synchronize()  # no copy may land in a block after it is freed
        alloc = self.manager.allocator
        alloc.free_many(self._allocated[::-1])
        alloc.free_many(self._acquired[::-1])
        self._allocated, self._acquired = [], []
        if self._claimed:
            self.epochs.abort(self.m.request_id, self.m.epoch)  # type: ignore[union-attr]
        if err is not None:
            self.metrics.record_error(err)


def import_sequence(manager: KVCacheManager, manifest, frames, plan: CompatPlan | None = None, *, seq_id=None,
                    epochs: EpochGuard | None = None, metrics: TransferMetrics | None = None,
                    limits: Limits = DEFAULT_LIMITS, stage: bool = False) -> ImportResult:
    """Import from a manifest (typed or msgpack bytes) and a list of frame buffers, in process.

    Raises a TransferError (counted in `metrics`) and leaves the pool unchanged on any failure.
    """
    metrics = metrics or DEFAULT_METRICS
    try:
        m = manifest if isinstance(manifest, Manifest) else decode_manifest(manifest, limits)
    except TransferError as e:
        metrics.record_error(e)
        raise
    session = ImportSession(manager, m, plan, seq_id=seq_id, epochs=epochs, metrics=metrics, stage=stage)
    try:
        if len(frames) != len(m.frames):
            raise FrameCountError(f"{len(frames)} frames for a manifest of {len(m.frames)}")
        for f, buf in enumerate(frames):
            mv = memoryview(buf).cast("B")
            if mv.nbytes != m.frames[f].nbytes:
                raise FrameSizeError(f"frame {f}: {mv.nbytes} bytes, manifest says {m.frames[f].nbytes}")
            cb = m.chunk_bytes
            for c in range(m.frames[f].num_chunks(cb)):
                bufs = session.chunk_buffers(f, c)
                pos = c * cb
                for b in bufs:
                    b[:] = mv[pos:pos + b.nbytes]
                    pos += b.nbytes
                session.chunk_done(f, c, pos - c * cb, bufs)
    except TransferError as e:
        session.abort(e)
        raise
    except BaseException:
        session.abort()
        raise
    return session.commit()
