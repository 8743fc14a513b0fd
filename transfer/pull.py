"""Payloads the receiver reads from the sender's pool (pull), for any control channel.

After its hello, a sender whose pool can be read from the other side offers it (`PoolOffer`:
a way and its description). The receiver opens it with that way's opener (declared in
`transfer.registry`, `register_source`) or declines (`PoolReply`); a declined offer leaves the
connection pushing bytes as before. A whole transfer whose frames all lie in the offered pool
then sends, instead of its payload, each frame's byte offset in it (`encode_offsets`); the
receiver reads every chunk straight into the blocks it reserved (`land_pulled`), verifies it
against the chunks' checksums, and commits or fails exactly as for pushed bytes. The checksums
follow the offsets (an "inline" manifest, then "K": the sender hashes while the receiver reads,
`read_ahead`), or come in the manifest. The sender's blocks stay leased until the ack, so
nothing it offers can change under the read.

Ways: "shm", a /dev/shm pool file on the same node (`ShmAdvert`, `ShmSource`: one memcpy, pool to
pool); "nixl", `transfer.channels.nixl.NixlSource`. A source is bounds-checked against
what the sender offered: an offset outside it is a MalformedMessage, never a read.
"""

from __future__ import annotations

import os
import stat

import numpy as np

from kvcache.shm_pool import PREFIX, SHM_DIR
from transfer.checksum import (
    PARALLEL_MIN_BYTES,
    checksum_many,
    checksum_parts,
    copy_hashed,
    spread,
    total_bytes,
    worker_pool,
)
from transfer.errors import FrameCountError, MalformedMessage, TransferError
from transfer.registry import source_opener
from transfer.wire_messages import PoolOffer

# A way's opener (transfer.registry.register_source): opener(blob: bytes, storage, host) -> a source
# with close(), `hashes` (whether it hashes while it copies) and read_many([(offset, bufs), ...],
# threads) -> per item, the xxh3-64 of what landed when the source hashed while copying, else None


def open_source(offer: PoolOffer, storage, host: str = "") -> PoolReader:
    """The reader of `offer` on this receiver (its pool: `storage`; `host`: its address in the
    cluster, for a way that listens on the network); MalformedMessage when the way is unknown here
    or the offer cannot be opened (another node's file, a garbled blob)."""
    opener = source_opener(offer.kind)
    if opener is None:
        raise MalformedMessage(f"no pool reader {offer.kind[:16]!r} here")
    return PoolReader(lambda: opener(offer.blob, storage, host))


class PoolReader:
    """A connection's reader of an offered pool: the way's source, opened again after a read that
    failed. A read that fails closes its source (a NIXL agent closes itself before raising, so that
    a late byte of an issued read cannot land in the blocks the failure frees); the next transfer
    on the connection reads through a new one instead of failing on the closed one."""

    def __init__(self, open_source):
        self._open = open_source
        self.source = open_source()
        self.hashes = self.source.hashes

    def read_many(self, items, threads: int = 1) -> list:
        if self.source is None:
            self.source = self._open()
        try:
            return self.source.read_many(items, threads)
        except TransferError:
            self.close()
            raise

    def close(self) -> None:
        source, self.source = self.source, None
        if source is not None:
            source.close()


def drop_source(owner) -> None:
    """Close and forget `owner.source` (a connection's), if it has one."""
    source, owner.source = owner.source, None
    if source is not None:
        source.close()


def encode_offsets(offsets: list[int]) -> bytes:
    """Pool offsets (or the chunk checksums that follow them, "K") as a little-endian uint64 array."""
    return np.asarray(offsets, dtype="<u8").tobytes()


def read_ahead(session, source, data, threads: int = 1) -> list[int] | None:
    """For a manifest whose checksums follow its offsets ("inline": the sender hashes while this
    side reads): read the whole payload now, when it lands straight in the reserved blocks; the
    xxh3-64 of what landed in each chunk, verified by `land_pulled(..., landed=)` once the
    checksums arrive. None: it goes through staging, so it is read then, chunk by chunk."""
    targets = session.direct_targets()
    if targets is None:
        return None
    offsets, cb = _offsets(session.manifest, data), session.manifest.chunk_bytes
    return _land_chunks(source, [(offsets[f] + c * cb, bufs) for f, c, _, bufs in targets], threads)


def land_pulled(session, source, data, threads: int = 1, sums=None, landed=None) -> None:
    """Read every chunk of `session`'s manifest from `source` at the frame offsets in `data`, in
    order, into the reserved blocks (`ImportSession.chunk_buffers`), each verified on landing
    (FrameCountError / ChecksumError / MalformedMessage: the caller aborts the session). `threads`
    share the chunks' copies and checksums when they land straight in the reserved blocks. sums:
    the chunks' checksums (`encode_offsets` bytes) when they came after the offsets (an "inline"
    manifest), else the manifest has them; landed: what `read_ahead` read already."""
    m = session.manifest
    offsets = _offsets(m, data)
    expect = _expected(session, sums)
    if landed is None:
        landed = read_ahead(session, source, data, threads)
    if landed is not None:  # straight into the reserved blocks: one read for the whole payload
        for i, ((f, c, nbytes, bufs), digest) in enumerate(zip(session.direct_targets(), landed)):
            session.chunk_buffers(f, c)  # then each chunk verified in order, as if it had arrived
            session.chunk_done(f, c, nbytes, bufs, expect[i], landed_checksum=digest)
        return
    i = 0
    while (nxt := session.next_chunk()) is not None:
        f, c, nbytes = nxt
        bufs = session.chunk_buffers(f, c)
        [digest] = _land_chunks(source, [(offsets[f] + c * m.chunk_bytes, bufs)], 1)
        session.chunk_done(f, c, nbytes, bufs, expect[i], landed_checksum=digest)
        i += 1


def _offsets(m, data) -> list[int]:
    if memoryview(data).nbytes != 8 * len(m.frames):
        raise FrameCountError(f"{memoryview(data).nbytes // 8} pool offsets for {len(m.frames)} frames")
    return np.frombuffer(data, dtype="<u8").tolist()


def _expected(session, sums) -> list:
    """Each chunk's checksum from `sums` for an "inline" manifest; Nones (the manifest's) otherwise."""
    m = session.manifest
    chunks = m.num_chunks
    if (m.checksum_mode == "inline") != (sums is not None):
        raise MalformedMessage("a pulled payload's checksums come in its manifest or after its offsets")
    if sums is None:
        return [None] * chunks
    if (session.next_chunk() or (0, 0))[:2] != (0, 0):  # its sums count from the first chunk
        raise MalformedMessage("payload chunks pushed before a pulled payload")
    if memoryview(sums).nbytes != 8 * chunks:
        raise FrameCountError(f"{memoryview(sums).nbytes // 8} checksums for {chunks} chunks")
    return np.frombuffer(sums, dtype="<u8").tolist()


def _land_chunks(source, items, threads: int) -> list[int]:
    """Read `items` ((offset, buffers) pairs) from `source`; the xxh3-64 of what landed in each
    item's buffers: the source's own when it hashed while copying (`hashes`), else hashed here
    after it landed. A source that does not hash (a NIXL agent's one-sided READ) is read in
    READ_GROUPS groups of items when there is more than one item and PARALLEL_MIN_BYTES to read,
    each group hashed on a worker thread while the next one is read."""
    total = total_bytes([bufs for _, bufs in items])
    if source.hashes or threads <= 1 or len(items) < 2 or total < PARALLEL_MIN_BYTES:
        digests = source.read_many(items, threads)
        missing = [i for i, d in enumerate(digests) if d is None]
        for i, d in zip(missing, checksum_many([items[i][1] for i in missing], threads)):
            digests[i] = d
        return digests
    size = -(-len(items) // READ_GROUPS)
    pending = []
    for at in range(0, len(items), size):
        group = items[at:at + size]
        source.read_many(group, 1)
        pending += [worker_pool(threads).submit(checksum_parts, bufs) for _, bufs in group]
    return [f.result() for f in pending]


READ_GROUPS = 4  # a non-hashing source's reads, each hashed while the next one lands


class ShmAdvert:
    """Sender side of "shm": a pool in a /dev/shm file (`kvcache.shm_pool`)."""

    way = "shm"

    def __init__(self, storage):
        self.storage = storage

    def offer(self) -> PoolOffer:
        return PoolOffer(self.way, self.storage.shm_path.encode())

    def offsets(self, frames) -> list[int] | None:
        """Each frame's byte offset in the pool, or None when one is not pool memory."""
        out = [self.storage.shm_offset(f) for f in frames]
        return None if None in out else out

    def close(self) -> None:
        pass


class ShmSource:
    """Receiver side of "shm": a same-node sender's pool file (a regular file of this user's in
    SHM_DIR named PREFIX...), mapped read-only."""

    hashes = True  # read_many hashes each window as it lands

    def __init__(self, blob: bytes, storage=None, host: str = ""):  # host: unused (same node)
        try:
            real = os.path.realpath(blob.decode("utf-8", "replace"))
            st = os.stat(real)  # FileNotFoundError: another node's file
            if (os.path.dirname(real) != SHM_DIR or not os.path.basename(real).startswith(PREFIX)
                    or not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid()):
                raise ValueError("not a pdserve pool file")
            self.map = np.memmap(real, dtype=np.uint8, mode="r")  # (file bytes,)
        except (OSError, ValueError):
            raise MalformedMessage("the offered pool file cannot be opened here (another node?)") from None

    def read_many(self, items, threads: int = 1) -> list[int]:
        """Copy each (offset in the sender's pool, destination buffers) item, the items shared by
        `threads` threads; each item's xxh3-64 of the bytes that landed, in order."""
        pairs, total = [], 0  # (destination buffers, their bytes in the pool)
        for offset, bufs in items:  # every bound checked before the first byte moves
            n = sum(b.nbytes for b in bufs)
            if offset + n > self.map.size:
                raise MalformedMessage("a chunk lies outside the sender's pool")
            pairs.append((bufs, self.map[offset:offset + n]))
            total += n
        return spread(lambda p: copy_hashed(*p), pairs, threads, total)

    def close(self) -> None:
        self.map = None


def shm_advert(storage):
    """The "shm" advert for a sender's pool, when it lives in /dev/shm (else None)."""
    return ShmAdvert(storage) if getattr(storage, "shm_path", None) else None

