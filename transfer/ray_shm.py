"""The Ray transport's same-node payload path: the receiver copies a transfer's frames straight
out of the sender's KV pool, which lives in a /dev/shm file (`kvcache.shm_pool`), so the payload
takes no actor-call argument and no object store: one copy, pool to pool.

Sender side: `pool_offsets` says where each export frame lies in the pool (None when a frame is
not pool memory, e.g. a re-blocked copy: that transfer goes through the object store). The
offsets cross as a raw little-endian uint64 array (`encode_offsets`). Receiver side: `PeerPool`
opens a sender's pool file read-only after checking it is one of ours (a `pdserve-kv-` file
directly in /dev/shm, a regular file owned by this user), and `frames` turns offsets into
bounded read-only views, refusing any count or range the manifest does not allow. A sender on
another node names a file the receiver cannot open, so the handshake leaves that connection on
the object store.
"""

from __future__ import annotations

import os
import stat

import numpy as np

from kvcache.shm_pool import PREFIX, SHM_DIR
from transfer.errors import MalformedMessage


def pool_offsets(storage, frames) -> list[int] | None:
    """Byte offset of each frame (a host buffer) inside `storage`'s pool file, or None when one
    is not pool memory."""
    if storage is None or storage.shm_path is None or frames is None:
        return None
    out = [storage.shm_offset(f) for f in frames]
    return None if None in out else out


def encode_offsets(offsets: list[int]) -> bytes:
    return np.asarray(offsets, dtype="<u8").tobytes()


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

    def frames(self, manifest, data: bytes) -> list[memoryview]:
        """Read-only views of the manifest's frames at the offsets in `data`."""
        if len(data) != 8 * len(manifest.frames):
            raise MalformedMessage(f"{len(data) // 8} pool offsets for {len(manifest.frames)} frames")
        offsets = np.frombuffer(data, dtype="<u8").tolist()
        out = []
        for off, frame in zip(offsets, manifest.frames):
            if off + frame.nbytes > self.map.size:
                raise MalformedMessage("a frame lies outside the sender's pool")
            out.append(memoryview(self.map[off:off + frame.nbytes]))
        return out


def open_peer_pool(path: str) -> PeerPool | None:
    """The sender's pool when this process can map it (same node), else None."""
    if not path:
        return None
    try:
        return PeerPool(path)
    except (OSError, ValueError, MalformedMessage):
        return None
