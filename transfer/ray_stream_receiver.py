"""Streamed migration over the Ray transport, receiver side: a mixin of `RayReceiverEndpoint`
(`transfer.ray_channel` is the sender, `transfer.ray_wire` the header schema). An offer checks the sealed
manifest, the handshake and admission (before any block is allocated), aborts an open stream of
the same transfer id (no connection close tells a Ray receiver that a sender died: the newer
attempt its reservation admits supersedes it) and opens an `ImportSession`, which reserves every
block of the sequence; each blocks call lands each chunk of a batch into the reserved blocks and
verifies its inline xxh3 right after landing; the final checks that the closing state continues
the offered sequence and that every batch the sender counted has landed, then commits (only then
is the sequence adopted). Any error aborts the stream as a whole (every reserved block returned)
and is answered by a nack, as is every later call of that stream. `expire_streams` aborts
streams idle past `idle_timeout_s` or running past `max_transfer_s` (a prefill worker that died
mid-stream and was not replaced); every call runs it, and an owner with a loop calls it each
iteration. One stream at a time per connection; the owner's thread only.
"""

from __future__ import annotations

import dataclasses
import time

from transfer.admission import refused
from transfer.codec import decode, encode, unseal
from transfer.errors import (
    FrameCountError,
    FrameSizeError,
    HandshakeRequired,
    MalformedMessage,
    TransferError,
    TransferTimeout,
    TransportClosed,
)
from transfer.importer import ImportResult, ImportSession
from transfer.messages import Ack, Final, Manifest, Nack
from transfer.ray_wire import BLOCKS, CANCEL, FINAL, OFFER, OK, StreamHeader, decode_header, encode_header

CALLS = (OFFER, BLOCKS, FINAL, CANCEL)


@dataclasses.dataclass
class _Stream:
    session: ImportSession
    token: int
    t0: float
    landed: int = 0  # BLOCKS calls landed and verified
    land_s: float = 0.0
    verify_s: float = 0.0


class RayStreamMixin:
    """Needs from the host class: manager, config, admission, epochs, metrics, stage, plans,
    handshaken, _turn_away."""

    def _init_streams(self) -> None:
        self._open_streams: dict[str, _Stream] = {}  # connection -> its stream in progress
        self._ended: dict[str, tuple[int, bytes]] = {}  # connection -> (its last ended stream, the verdict)

    def _streams(self) -> dict[str, _Stream]:
        return self._open_streams

    # ---- the owner's entry point ------------------------------------------------------------------
    def stream_call(self, call: str, conn: str, header: bytes, body,
                    frames) -> tuple[bytes, ImportResult | None]:
        """One stream call: the reply for the sender, and the committed import (a final's, else None)."""
        self.expire_streams()
        if self.handshaken(conn) is None:  # NOTE: refused unread (convention 15)
            return self._turn_away(HandshakeRequired("stream call on a connection without a handshake")), None
        conn = str(conn)[:128]
        try:
            if call not in CALLS:
                raise MalformedMessage(f"unknown stream call {call!r}")
            h = decode_header(header, self.config.limits, call)
        except TransferError as e:  # a garbled call ends the connection's stream, if one is open
            st = self._streams().get(conn)
            if st is not None:
                return self._abort(conn, st, e), None
            self.metrics.record_error(e)
            return encode(Nack("", 0, e.code, str(e))), None
        st = self._streams().get(conn)
        if call == OFFER:
            if st is not None and st.token == h.token:  # a duplicated offer
                self.metrics.add("duplicate_manifests")
                return self._ok(h.token, st.landed), None
            ended = self._ended.get(conn)
            if ended is not None and ended[0] == h.token:  # a duplicate of an offer that already ended
                self.metrics.add("duplicate_manifests")
                return ended[1], None
            if st is not None:
                self._abort(conn, st, FrameCountError("new offer before the previous stream ended"))
            return self._offer(conn, h.token, body), None
        if st is None or st.token != h.token:
            ended = self._ended.get(conn)
            if ended is not None and ended[0] == h.token and call != CANCEL:
                return ended[1], None  # the verdict that ended this stream, again
            if call == CANCEL:
                return self._ok(h.token, 0), None
            err = TransportClosed(f"stream {h.token} is not open on this connection")
            self.metrics.record_error(err)
            return encode(Nack("", 0, err.code, str(err))), None
        try:
            if call == CANCEL:
                raise TransportClosed("the sender cancelled the stream")
            if call == BLOCKS:
                self._land(st, h, frames)
                st.session.last_activity = time.monotonic()
                return self._ok(h.token, st.landed), None
            return self._final(conn, st, h, body)
        except TransferError as e:
            return self._abort(conn, st, e), None

    def expire_streams(self) -> int:
        """Abort streams idle past idle_timeout_s or running past max_transfer_s; how many."""
        now, cfg, n = time.monotonic(), self.config, 0
        for conn, st in list(self._streams().items()):
            silent, age = now - st.session.last_activity, now - st.session.started
            if silent > cfg.idle_timeout_s or age > cfg.max_transfer_s:
                why = f"silent for {silent:.1f}s" if silent > cfg.idle_timeout_s else f"running {age:.1f}s"
                self._abort(conn, st, TransferTimeout(f"stream of {st.session.manifest.request_id!r}: {why}"))
                n += 1
        return n

    def abort_streams(self, request_id: str) -> int:
        """Abort the streams of request `request_id` (its transfer ids are 'request_id/i')."""
        n = 0
        for conn, st in list(self._streams().items()):
            if st.session.manifest.request_id.rpartition("/")[0] == request_id:
                self._abort(conn, st, TransportClosed(f"request {request_id!r} was aborted"))
                n += 1
        return n

    def in_flight(self) -> dict[str, list[int]]:
        """Transfer id -> receiver blocks reserved by a stream not committed yet."""
        return {st.session.manifest.request_id: list(st.session.dst_blocks)
                for st in self._streams().values()}

    # ---- steps ------------------------------------------------------------------------------------
    def _ok(self, token: int, landed: int) -> bytes:
        return encode_header(StreamHeader(OK, token, landed))

    def _abort(self, conn: str, st: _Stream, err: TransferError) -> bytes:
        """End the stream: every reservation released, the error counted once, the nack remembered."""
        self._streams().pop(conn, None)
        st.session.abort(err)
        m = st.session.manifest
        reply = encode(Nack(m.request_id, m.epoch, err.code, str(err)))
        self._remember(conn, st.token, reply)
        return reply

    def _remember(self, conn: str, token: int, reply: bytes) -> None:
        self._ended.pop(conn, None)
        self._ended[conn] = (token, reply)
        if len(self._ended) > 4096:  # bounded, like the handshakes: the oldest connection goes
            self._ended.pop(next(iter(self._ended)))

    def _offer(self, conn: str, token: int, body) -> bytes:
        t0 = time.perf_counter()
        try:
            m = decode(unseal(body), self.config.limits, Manifest)
            entry = self.plans.get(conn)
            if entry is None:
                raise HandshakeRequired("stream offered on a connection without a handshake")
            if m.checksum_mode != "inline":
                raise MalformedMessage("a streamed offer's chunks carry inline checksums")
        except TransferError as e:
            self.metrics.record_error(e)
            return self._refusal(conn, token, e)
        plan, peer = entry
        if not self.admission.admit_transfer(m.request_id, m.epoch, peer):
            self.metrics.record_error(refused())
            return self._refusal(conn, token, refused())  # NOTE: before any block is allocated
        for other, st in list(self._streams().items()):  # NOTE: no connection close tells us a sender
            if st.session.manifest.request_id == m.request_id:  # died: its admitted successor does
                self._abort(other, st, TransportClosed(f"stream of {m.request_id!r} superseded by epoch "
                                                       f"{m.epoch} from {peer!r}"))
        try:
            session = ImportSession(self.manager, m, plan, epochs=self.epochs, metrics=self.metrics,
                                    stage=self.stage, make_room=getattr(self.admission, "make_room", None))
        except TransferError as e:  # counted and released by the session
            return self._refusal(conn, token, e, m)
        self._streams()[conn] = _Stream(session, token, t0)
        return self._ok(token, 0)

    def _refusal(self, conn: str, token: int, err: TransferError, m: Manifest | None = None) -> bytes:
        reply = encode(Nack(m.request_id if m else "", m.epoch if m else 0, err.code, str(err)))
        self._remember(conn, token, reply)
        return reply

    def _land(self, st: _Stream, h: StreamHeader, frames) -> None:
        """Copy each chunk into its reserved blocks, then verify it there (FrameCountError,
        FrameSizeError, ChecksumError: the caller aborts the stream)."""
        if h.seq != st.landed:
            raise FrameCountError(f"block call {h.seq} of the stream arrived, expected {st.landed}")
        if len(frames) != len(h.frames):
            raise FrameCountError(f"{len(frames)} payload arrays for a header of {len(h.frames)} chunks")
        s = st.session
        for f, c, cs, arr in zip(h.frames, h.chunks, h.sums, frames):
            t0 = time.perf_counter()
            try:
                view = memoryview(arr).cast("B")
            except (TypeError, ValueError):
                raise MalformedMessage(f"chunk ({f}, {c}) is not a byte buffer") from None
            bufs = s.chunk_buffers(f, c)  # FrameCountError unless (f, c) comes next
            if view.nbytes != sum(b.nbytes for b in bufs):
                raise FrameSizeError(f"chunk ({f}, {c}): {view.nbytes} bytes, expected "
                                     f"{sum(b.nbytes for b in bufs)}")
            pos = 0
            for b in bufs:
                b[:] = view[pos:pos + b.nbytes]
                pos += b.nbytes
            t1 = time.perf_counter()
            s.chunk_done(f, c, pos, bufs, cs)  # verified while the chunk is still in cache
            st.land_s, st.verify_s = st.land_s + t1 - t0, st.verify_s + time.perf_counter() - t1
        st.landed += 1

    def _final(self, conn: str, st: _Stream, h: StreamHeader, body) -> tuple[bytes, ImportResult]:
        s = st.session
        final = decode(unseal(body), self.config.limits, Final)
        m, n = s.manifest, s.manifest.num_tokens
        if (final.request_id, final.epoch) != (m.request_id, m.epoch) \
                or final.state.token_ids[:n] != m.state.token_ids[:n] or len(final.state.token_ids) < n:
            raise MalformedMessage("final state does not continue the offered sequence")
        if h.seq != st.landed:
            raise FrameCountError(f"final after {h.seq} block calls, {st.landed} landed")
        s.manifest = dataclasses.replace(m, state=final.state)
        s.timings["land_ms"], s.timings["verify_ms"] = st.land_s * 1e3, st.verify_s * 1e3
        s.timings["recv_ms"] = (time.perf_counter() - st.t0) * 1e3
        result = s.commit()  # FrameCountError (aborted) if a chunk is missing
        self._streams().pop(conn, None)
        reply = encode(Ack(result.request_id, result.epoch, result.new_blocks, result.reused_blocks,
                           result.nbytes, result.timings))
        self._remember(conn, st.token, reply)
        return reply, result
