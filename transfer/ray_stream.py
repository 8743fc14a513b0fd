"""Streamed migration over the Ray transport, sender side, and the explicit msgpack schema of its
per-call headers. `migrate_streamed` offers the sequence (`kv_offer`: a sealed `StreamedExport`
manifest; the receiver reserves every block), sends each batch of complete blocks the feed
yields as one `kv_blocks` call (a `StreamHeader` naming each chunk's frame, index and inline
xxh3, then one zero-copy array per chunk) and closes with `kv_final` (the sealed `Final`). At
most one call is outstanding: the reply of the previous call is awaited, bounded, before the
next goes, so a threaded actor can never see chunks, or the final, out of order; the previous
batch lands while the feed waits for the next prefill chunk. A nack ends the stream with the
receiver's typed error (its reservation already released); a feed that fails or ends without a
final state sends `kv_cancel`. Nothing of ours is pickled: headers and replies are msgpack bytes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgpack
import numpy as np

from transfer.codec import decode_reply, encode, seal, unpack
from transfer.errors import MalformedMessage, TransferError, TransportClosed
from transfer.manifest import PROTOCOL_VERSION
from transfer.messages import Ack, Final, Nack
from transfer.schema import U32, U64, Limits, get_int, get_packed, get_str, pack, require_keys
from transfer.stream_export import offer_for
from transfer.transport import RECEIVER_PHASES

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


def _answer(sender, data, token: int, final: bool):
    """The receiver's reply to one stream call: OK, or the Ack for the final; a nack raises its
    typed error. Every error is counted in the sender's metrics."""
    limits, metrics = sender.config.limits, sender.metrics
    if final:
        return decode_reply(data, Ack, limits, metrics)
    try:
        if unpack(data, limits).get("kind") == OK:
            h = decode_header(data, limits, OK)
            if h.token != token:
                raise MalformedMessage(f"reply for stream {h.token}, expected {token}")
            return h
    except TransferError as e:
        metrics.record_error(e)
        raise
    return decode_reply(data, Nack, limits, metrics)  # raises: the nack's error, or MalformedMessage


class _Calls:
    """One stream's calls to the receiving actor, at most one outstanding."""

    def __init__(self, sender, token: int, limit: float):
        self.sender, self.token, self.limit = sender, token, limit
        self.pending = None
        self.seq = 0

    def wait(self) -> None:
        if self.pending is not None:
            ref, self.pending = self.pending, None
            _answer(self.sender, self.sender._get(ref, self.limit, "stream reply"), self.token, False)

    def submit(self, method: str, header: StreamHeader, *args) -> None:
        self.wait()
        actor = self.sender.actor
        self.pending = getattr(actor, method).remote(self.sender.conn, encode_header(header), *args)

    def cancel(self) -> None:
        """Fire and forget: the receiver aborts the stream (it expires it anyway when idle)."""
        try:
            header = encode_header(StreamHeader(CANCEL, self.token))
            self.sender.actor.kv_cancel.remote(self.sender.conn, header)
        except Exception:  # the actor is gone: nothing left to cancel
            pass


def migrate_streamed(sender, manager, request_id: str, epoch: int, token_ids: list[int], sampling: dict,
                     feed, extra_key: str | None = None, timeout: float | None = None) -> Ack:
    """`RaySender.migrate_streamed`: the contract of `ZmqSender.migrate_streamed` (see the module)."""
    sender.plan or sender.connect(timeout)
    t0 = time.perf_counter()
    sx = offer_for(sender, manager, request_id, epoch, token_ids, sampling, extra_key, timeout)
    m, limit = sx.manifest, timeout or sender.config.transfer_timeout_s
    sender.stream_token += 1
    calls = _Calls(sender, sender.stream_token, limit)
    faults = sender.faults
    fault = faults.take() if faults is not None else None  # the chaos benchmark
    bodies = faults.manifest(fault, seal(encode(m))) if fault else [seal(encode(m))]
    state, early_bytes = None, 0
    try:  # a dropped offer (no body): the receiver refuses the blocks of a stream it never saw
        for body in bodies:
            calls.submit("kv_offer", StreamHeader(OFFER, calls.token), body)
        for item in feed:
            last = isinstance(item, tuple)  # (the last blocks, the final state): the prefill is done
            blocks = item[0] if last else item
            early_bytes += 0 if last else sx.nbytes(blocks)
            pieces = sx.chunks(blocks)
            if fault and blocks:  # a data fault hits the first batch of blocks
                pieces, fault = faults.chunks(fault, pieces), None
            pieces = list(pieces)
            if pieces:  # Ray copies each array into its object store (or inline) at submission
                keys = [k for k, _ in pieces]
                header = StreamHeader(BLOCKS, calls.token, calls.seq, tuple(k[0] for k in keys),
                                      tuple(k[1] for k in keys), tuple(k[3] for k in keys))
                calls.submit("kv_blocks", header, *[np.frombuffer(v, dtype=np.uint8) for _, v in pieces])
                calls.seq += 1
            if last:
                state = item[1]
                break
        t1 = time.perf_counter()
        if state is None:
            raise TransportClosed("streamed migration cancelled before its final state")
        calls.wait()  # every batch landed and verified before the final goes
    except BaseException:  # a nack (counted, the receiver already aborted), a timeout, the feed's error
        calls.cancel()
        raise
    final = seal(encode(Final(m.request_id, m.epoch, state)))
    header = encode_header(StreamHeader(FINAL, calls.token, calls.seq))
    data = sender._get(sender.actor.kv_final.remote(sender.conn, header, final), limit, "ack")
    ack = _answer(sender, data, calls.token, True)
    t2 = time.perf_counter()
    sender.metrics.add("transfers")
    sender.metrics.add("bytes_sent", ack.nbytes)
    sender.last_phases = {"streamed_ms": (t1 - t0) * 1e3, "exposed_ms": (t2 - t1) * 1e3,
                          "overlap_pct": 100.0 * early_bytes / max(1, m.payload_bytes),
                          **{k: v for k, v in ack.timings.items() if k in RECEIVER_PHASES}}
    return ack
