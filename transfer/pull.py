"""Payloads the receiver reads from the sender's pool (pull), for any control channel.

After its hello, a sender whose pool can be read from the other side offers it (`PoolOffer`:
a way and its description). The receiver opens it with that way's opener (`SOURCES`, one entry
per way) or declines (`PoolReply`); a declined offer leaves the connection pushing bytes as
before. A whole transfer whose frames all lie in the offered pool then sends, instead of its
payload, each frame's byte offset in it (`encode_offsets`); the receiver reads every chunk
straight into the blocks it reserved (`land_pulled`), verifies it against the manifest's
checksums, and commits or fails exactly as for pushed bytes. The sender's blocks stay leased
until the ack, so nothing it offers can change under the read.

Ways: "shm", a /dev/shm pool file on the same node (`ShmAdvert`, `ShmSource`: one memcpy, pool to
pool); "nixl" registers itself from `transfer.nixl_channel`. A source is bounds-checked against
what the sender offered: an offset outside it is a MalformedMessage, never a read.
"""

from __future__ import annotations

import functools
import os
import stat

import numpy as np

from kvcache.shm_pool import PREFIX, SHM_DIR
from transfer.errors import FrameCountError, MalformedMessage
from transfer.messages import PoolOffer

# way -> opener(blob: bytes, storage) -> a source with read_many([(offset, bufs), ...]) and close()
SOURCES: dict = {}


def register_source(way: str, opener) -> None:
    SOURCES[way] = opener


def open_source(offer: PoolOffer, storage):
    """The source for `offer` on this receiver (its pool: `storage`); MalformedMessage when the way
    is unknown here or the offer cannot be opened (another node's file, a garbled blob)."""
    opener = SOURCES.get(offer.kind)
    if opener is None:
        raise MalformedMessage(f"no pool reader {offer.kind[:16]!r} here")
    return opener(offer.blob, storage)


def drop_source(owner) -> None:
    """Close and forget `owner.source` (a connection's), if it has one."""
    source, owner.source = owner.source, None
    if source is not None:
        source.close()


def encode_offsets(offsets: list[int]) -> bytes:
    return np.asarray(offsets, dtype="<u8").tobytes()


def land_pulled(session, source, data) -> None:
    """Read every chunk of `session`'s manifest from `source` at the frame offsets in `data`, in
    order, into the reserved blocks (`ImportSession.chunk_buffers`), each verified on landing
    (FrameCountError / ChecksumError / MalformedMessage: the caller aborts the session)."""
    m = session.manifest
    if memoryview(data).nbytes != 8 * len(m.frames):
        raise FrameCountError(f"{memoryview(data).nbytes // 8} pool offsets for {len(m.frames)} frames")
    if m.checksum_mode != "manifest":
        raise MalformedMessage("a pulled payload is verified against the manifest's checksums")
    offsets = np.frombuffer(data, dtype="<u8").tolist()
    targets = session.direct_targets()
    if targets is not None:  # straight into the reserved blocks: one read for the whole payload
        source.read_many([(offsets[f] + c * m.chunk_bytes, bufs) for f, c, _, bufs in targets])
        for f, c, nbytes, bufs in targets:  # then each chunk verified in order, as if it had arrived
            session.chunk_buffers(f, c)
            session.chunk_done(f, c, nbytes, bufs)
        return
    while (nxt := session.next_chunk()) is not None:
        f, c, nbytes = nxt
        bufs = session.chunk_buffers(f, c)
        source.read_many([(offsets[f] + c * m.chunk_bytes, bufs)])
        session.chunk_done(f, c, nbytes, bufs)


class PeerPool:
    """A same-node sender's pool file, mapped read-only."""

    def __init__(self, path: str):
        real = os.path.realpath(path)
        name = os.path.basename(real)
        if os.path.dirname(real) != SHM_DIR or not name.startswith(PREFIX):
            raise MalformedMessage("not a pdserve pool file")
        st = os.stat(real)  # FileNotFoundError (another node) is the caller's to catch
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise MalformedMessage("not a pdserve pool file")
        self.path = real
        self.map = np.memmap(real, dtype=np.uint8, mode="r")  # (file bytes,)


def open_peer_pool(path: str) -> PeerPool | None:
    """The sender's pool when this process can map it (same node), else None."""
    if not path:
        return None
    try:
        return PeerPool(path)
    except (OSError, ValueError, MalformedMessage):
        return None


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
    """Receiver side of "shm": the sender's pool file mapped read-only (`PeerPool` checks it)."""

    def __init__(self, blob: bytes, storage=None):
        pool = open_peer_pool(blob.decode("utf-8", "replace"))
        if pool is None:
            raise MalformedMessage("the offered pool file cannot be opened here (another node?)")
        self.map = pool.map

    # copy threads per chunk: two did not pay on a 2-core machine (`python -m bench.shm_copy`, two
    # runs: 6.2-6.5 GB/s with one thread, 4.5-6.6 with two, memcpy 11.3-12.3), so one
    threads = 1

    def read_many(self, items) -> None:
        """(offset in the sender's pool, destination buffers) pairs, each read in order."""
        for offset, bufs in items:
            self.read(offset, bufs)

    def read(self, offset: int, bufs) -> None:
        n = sum(b.nbytes for b in bufs)
        if offset + n > self.map.size:
            raise MalformedMessage("a chunk lies outside the sender's pool")
        pairs, pos = [], offset
        for b in bufs:  # (destination, source) as uint8 arrays: numpy copies without the GIL
            pairs.append((np.frombuffer(b, dtype=np.uint8), self.map[pos:pos + b.nbytes]))
            pos += b.nbytes
        if self.threads > 1 and n >= SPLIT_MIN_BYTES:  # halves copied side by side
            pairs = [half for d, s in pairs for half in ((d[:len(d) // 2], s[:len(d) // 2]),
                                                         (d[len(d) // 2:], s[len(d) // 2:]))]
            list(_copier(self.threads).map(lambda p: np.copyto(p[0], p[1]), pairs))
        else:
            for d, s in pairs:
                np.copyto(d, s)

    def close(self) -> None:
        self.map = None


SPLIT_MIN_BYTES = 1 << 20  # a smaller chunk is copied by the calling thread alone
@functools.cache
def _copier(threads: int):
    import concurrent.futures

    return concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="kv-copy")


def shm_advert(storage):
    """The "shm" advert for a sender's pool, when it lives in /dev/shm (else None)."""
    return ShmAdvert(storage) if getattr(storage, "shm_path", None) else None


register_source("shm", ShmSource)
