"""The Ray channel's wire: the explicit msgpack schema of a streamed transfer's per-call headers
(`kv_offer`, `kv_blocks`, `kv_final`, `kv_cancel`, and the receiver's OK). A `StreamHeader` names
the stream (a per-connection token), the call's place in it, and for a `kv_blocks` call each
payload array's frame, chunk index and inline xxh3. Nothing of ours is pickled: headers and
replies are msgpack bytes, payload pieces raw arrays (`ray_channel`, `ray_stream_receiver`).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from transfer.codec import unpack
from transfer.errors import MalformedMessage
from transfer.manifest import PROTOCOL_VERSION
from transfer.schema import U32, U64, Limits, get_int, get_packed, get_str, pack, require_keys

OFFER, BLOCKS, FINAL, CANCEL, OK = "ray_offer", "ray_blocks", "ray_final", "ray_cancel", "ray_ok"
KINDS = (OFFER, BLOCKS, FINAL, CANCEL, OK)
MAX_TOKEN = (1 << 63) - 1


@dataclass(frozen=True)
class StreamHeader:
    """One stream call's header (or the receiver's OK reply). token: the stream on this connection
    (the sender counts them); seq: for BLOCKS, the call's index in the stream; for FINAL, how many
    BLOCKS calls were sent; for OK, how many landed. frames/chunks/sums: one entry per payload
    array of a BLOCKS call (empty for every other kind)."""

    kind: str
    token: int
    seq: int = 0
    frames: tuple = ()
    chunks: tuple = ()
    sums: tuple = ()

    def to_wire(self) -> dict:
        return {"v": PROTOCOL_VERSION, "kind": self.kind, "token": self.token, "seq": self.seq,
                "frames": pack(self.frames, U32), "chunks": pack(self.chunks, U32),
                "sums": pack(self.sums, U64)}

    @classmethod
    def from_wire(cls, wire, limits: Limits) -> StreamHeader:
        what = "stream header"
        require_keys(wire, {"v", "kind", "token", "seq", "frames", "chunks", "sums"}, what)
        kind = get_str(wire, "kind", 16, what)
        if kind not in KINDS:
            raise MalformedMessage(f"{what}: unknown kind {kind!r}")
        frames = get_packed(wire, "frames", U32, limits.max_chunks, what)
        chunks = get_packed(wire, "chunks", U32, limits.max_chunks, what)
        sums = get_packed(wire, "sums", U64, limits.max_chunks, what)
        if not len(frames) == len(chunks) == len(sums):
            raise MalformedMessage(f"{what}: {len(frames)} frames, {len(chunks)} chunks, {len(sums)} sums")
        if kind != BLOCKS and len(frames):
            raise MalformedMessage(f"{what}: a {kind} names no chunks")
        return cls(kind, get_int(wire, "token", 1, MAX_TOKEN, what),
                   get_int(wire, "seq", 0, limits.max_chunks, what), tuple(frames.tolist()),
                   tuple(chunks.tolist()), tuple(int(s) for s in sums.tolist()))


def encode_header(header: StreamHeader) -> bytes:
    return msgpack.packb(header.to_wire(), use_bin_type=True)


def decode_header(data, limits: Limits, kind: str | None = None) -> StreamHeader:
    """Bounded, strict decode (MalformedMessage / LimitExceeded); `kind`: the one expected."""
    h = StreamHeader.from_wire(unpack(data, limits), limits)
    if kind is not None and h.kind != kind:
        raise MalformedMessage(f"stream header of kind {h.kind!r} where {kind!r} was expected")
    return h
