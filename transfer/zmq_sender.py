"""ZeroMQ sender (prefill side): a DEALER socket connected to one receiver; the wire format is in
`transfer.zmq_wire`. `connect` does the once-per-connection handshake, `query` the dedupe
question, `send` streams one export (each chunk hashed, then sent zero-copy from pool memory or
a staging slot: on the data stream, or behind the manifest on this socket when the payload is
at most `inline_bytes`) and waits for the ack, and `migrate` strings them together. Every wait is a
bounded poll. On an ack or nack the export's lease is released; on a timeout the connection is
reset and the lease is left to expire (the receiver may or may not have committed).
"""

from __future__ import annotations

import time

import zmq

from transfer.blocks import prefix_hashes_at
from transfer.checksum import checksum
from transfer.codec import decode_reply, encode, seal
from transfer.errors import (
    HandshakeRequired,
    MalformedMessage,
    TransferError,
    TransferTimeout,
    TransportClosed,
)
from transfer.export import ExportedSequence
from transfer.messages import Ack, Final, Held, HelloReply, Query
from transfer.metrics import DEFAULT_METRICS, TransferMetrics
from transfer.reblock import CompatPlan, check_compatible
from transfer.stream_export import offer_for
from transfer.stream_sender import DataStream
from transfer.stream_wire import parse_address
from transfer.transport import RECEIVER_PHASES, TransportConfig, check_reply, make_hello, migrate
from transfer.zmq_wire import DATA, TOKEN


class ZmqSender:
    """One connection from a prefill worker (layout `fingerprint`) to a receiver at config.address."""

    def __init__(self, fingerprint: dict, config: TransportConfig | None = None, *,
                 metrics: TransferMetrics | None = None, faults=None):
        self.fingerprint, self.config = dict(fingerprint), config or TransportConfig()
        self.metrics = metrics or DEFAULT_METRICS
        self.faults = faults  # transfer.faults.Faults (chaos benchmark), or None
        self.ctx = zmq.Context(io_threads=self.config.io_threads)
        self.sock = None
        self.plan: CompatPlan | None = None
        self.last_phases: dict[str, float] = {}  # of the last migration (transport.migrate)
        self.stream: DataStream | None = None  # the raw data stream, when the receiver offered one
        self._token = 0
        self._open()

    def _open(self) -> None:
        s = self.sock = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 0)  # chunks are zero-copy references: queueing them costs no memory
        s.setsockopt(zmq.MAXMSGSIZE, self.config.limits.max_message_bytes)  # replies are small
        if self.config.socket_buffer_bytes:
            s.setsockopt(zmq.SNDBUF, self.config.socket_buffer_bytes)
            s.setsockopt(zmq.RCVBUF, self.config.socket_buffer_bytes)
        s.connect(self.config.address)
        self.plan = None

    def _reset(self) -> None:
        self.sock.close(0)
        self._close_stream()
        self._open()

    def _close_stream(self) -> None:
        """Close the data stream's socket; the next transfer opens a fresh one (same token)."""
        if self.stream is not None:
            self.stream.close()

    def close(self) -> None:
        self._close_stream()
        self.sock.close(0)
        self.ctx.term()

    # ---- waiting ------------------------------------------------------------------------------
    def _recv_reply(self, headers: tuple[bytes, ...]):
        """One queued reply if it is one of `headers` (or a garbled-message nack), else None."""
        parts = self.sock.recv_multipart()
        if len(parts) == 2 and (parts[0] in headers or parts[0] == b"N"):
            return parts
        self.metrics.add("stray_replies")
        return None

    def _wait(self, headers: tuple[bytes, ...], deadline: float, what: str):
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(max(1, int(left * 1000))):
                err = TransferTimeout(f"no {what} from {self.config.address} within the timeout")
                self.metrics.record_error(err)
                self._reset()
                raise err
            got = self._recv_reply(headers)
            if got is not None:
                return got

    # ---- contract -----------------------------------------------------------------------------
    def connect(self, timeout: float | None = None) -> CompatPlan:
        """Handshake: exchange layout fingerprints once; FingerprintMismatch if incompatible."""
        deadline = time.monotonic() + (timeout or self.config.connect_timeout_s)
        scheme, where = parse_address(self.config.address)
        want = scheme if self.config.data_plane == "stream" else ""
        hello = make_hello(self.fingerprint, self.config, want)
        self.sock.send_multipart([b"H", encode(hello)])
        _, body = self._wait((b"h",), deadline, "handshake reply")
        reply = _reply_of(self, body, HelloReply)
        try:
            check_reply(reply, hello, self.config)  # signed for this hello, by the receiver we meant
            self.plan = check_compatible(self.fingerprint, reply.fingerprint)
        except TransferError as e:
            self.metrics.record_error(e)
            raise
        self._close_stream()
        self.stream = None
        if reply.data_token and (reply.data_port or reply.data_path):
            at = ("tcp", where, reply.data_port) if want == "tcp" else ("ipc", reply.data_path)
            self.stream = DataStream(at, reply.data_token, self.config.connect_timeout_s)
        return self.plan

    def query(self, request_id: str, token_ids, extra_key: str | None = None,
              timeout: float | None = None) -> list[int]:
        """Receiver logical blocks (its block size) of this prefix that it already holds."""
        plan = self.plan or self.connect(timeout)
        hashes = prefix_hashes_at(token_ids, plan.dst_block_size, extra_key)
        if not hashes:
            return []
        deadline = time.monotonic() + (timeout or self.config.connect_timeout_s)
        self.sock.send_multipart([b"Q", encode(Query(str(request_id), plan.dst_block_size, tuple(hashes)))])
        _, body = self._wait((b"q",), deadline, "dedupe reply")
        held = _reply_of(self, body, Held).held
        if any(not 0 <= i < len(hashes) for i in held):
            err = MalformedMessage("dedupe reply names blocks outside the query")
            self.metrics.record_error(err)
            raise err
        return sorted(set(held))

    def send(self, exported: ExportedSequence, timeout: float | None = None) -> Ack:
        """Stream one export and wait for its ack; raises the receiver's typed error on a nack."""
        if self.plan is None:
            self.connect()
        m = exported.manifest
        self._token += 1
        token, ack_header = self._token, TOKEN.pack(b"A", self._token)
        deadline = time.monotonic() + (timeout or self.config.transfer_timeout_s)
        sock, inline, reply = self.sock, m.checksum_mode == "inline", None
        fault = self.faults.take() if self.faults is not None else None
        bodies = [seal(encode(m))]
        items = (((f, c, slot, checksum(view) if inline else 0), view)
                 for f, c, view, slot in exported.chunks())
        if fault is not None:  # chaos benchmark: after hashing, so a flipped copy fails its checksum
            bodies, items = self.faults.manifest(fault, bodies[0]), self.faults.chunks(fault, items)
        if self.stream is not None and m.payload_bytes > self.config.inline_bytes:
            return self._send_streamed(exported, token, bodies, items, deadline)
        # control socket: the data-plane "zmq", or a payload small enough to follow its manifest
        try:
            for body in bodies:
                sock.send_multipart([TOKEN.pack(b"M", token), body])
            for (f, c, slot, cs), view in items:
                tracker = sock.send_multipart([DATA.pack(b"D", token, f, c, cs), view], copy=False,
                                              track=slot is not None)
                if slot is not None:
                    slot.tracker = tracker
                if sock.poll(0):  # an early nack (the receiver gave up): stop streaming
                    reply = self._recv_reply((ack_header,))
                    if reply is not None:
                        break
                if time.monotonic() > deadline:
                    break
            else:
                sock.send_multipart([TOKEN.pack(b"E", token), b""])
        except TransferError as e:  # e.g. a staging slot the transport never released
            self.metrics.record_error(e)
            self._reset()
            raise
        return self._finish(exported, reply, ack_header, deadline)

    def _send_streamed(self, exported: ExportedSequence, token: int, bodies, items, deadline: float) -> Ack:
        """Manifest on the control socket, payload on the data stream, verdict on the control socket."""
        ack_header, early = TOKEN.pack(b"A", token), []
        answered = self._answered(ack_header, early, deadline)
        sock = self.sock
        try:
            self.stream.open()
            for body in bodies:
                sock.send_multipart([TOKEN.pack(b"S", token), body])
            self.stream.send(token, exported.manifest.payload_bytes, items, answered)
        except TransferError as e:  # the stream would not open, or a staging slot was never released
            self.metrics.record_error(e)
            self._reset()
            raise
        try:
            return self._finish(exported, early[0] if early else None, ack_header, deadline)
        except TransferError:
            self._close_stream()  # the receiver closed its end: the next transfer opens a fresh stream
            raise

    def _answered(self, ack_header: bytes, early: list, deadline: float):
        """A check for an early verdict (the receiver gave up): the caller stops streaming."""
        def answered() -> bool:
            if not early and self.sock.poll(0):
                got = self._recv_reply((ack_header,))
                if got is not None:
                    early.append(got)
            return bool(early) or time.monotonic() > deadline
        return answered

    def _finish(self, exported: ExportedSequence | None, reply, ack_header: bytes, deadline: float) -> Ack:
        if reply is None:
            reply = self._wait((ack_header,), deadline, "ack")
        try:
            ack = _reply_of(self, reply[1], Ack)
        finally:
            if exported is not None:
                exported.release()  # the receiver answered: it no longer reads our blocks
        self.metrics.add("transfers")
        self.metrics.add("bytes_sent", ack.nbytes)
        return ack

    def migrate_streamed(self, manager, request_id: str, epoch: int, token_ids: list[int], sampling: dict,
                         feed, extra_key: str | None = None, timeout: float | None = None) -> Ack:
        """A streamed migration (transfer.stream_export): offer the sequence now, send its blocks as
        `feed` yields them (lists of (logical, physical) blocks whose K/V is complete), and close
        with the (last blocks, DecodeState) pair it yields last; a feed that ends without one
        cancels the stream. last_phases: streamed_ms (offer to final), exposed_ms (final to ack),
        overlap_pct (payload sent before the prefill finished) and the receiver's phases.
        Needs the data stream (HandshakeRequired otherwise). Raises the receiver's typed error."""
        self.plan or self.connect(timeout)
        if self.stream is None:
            raise HandshakeRequired("a streamed migration needs the receiver's data stream")
        t0 = time.perf_counter()
        sx = offer_for(self, manager, request_id, epoch, token_ids, sampling, extra_key, timeout)
        m, limit = sx.manifest, timeout or self.config.transfer_timeout_s
        self._token += 1
        token, ack_header, early = self._token, TOKEN.pack(b"A", self._token), []
        answered = self._answered(ack_header, early, float("inf"))
        self.stream.open()
        fault = self.faults.take() if self.faults is not None else None  # the chaos benchmark
        bodies = self.faults.manifest(fault, seal(encode(m))) if fault else [seal(encode(m))]
        for body in bodies:
            self.sock.send_multipart([TOKEN.pack(b"O", token), body])
        ok, state, early_bytes = self.stream.begin(token, m.payload_bytes), None, 0
        try:
            for item in feed:
                last = isinstance(item, tuple)  # (the last blocks, the final state): the prefill is done
                blocks = item[0] if last else item
                early_bytes += 0 if last else sx.nbytes(blocks)
                items = sx.chunks(blocks)
                if fault and blocks:  # a data fault hits the first batch of blocks
                    items, fault = self.faults.chunks(fault, items), None
                if not (ok and self.stream.send_chunks(items, answered)):
                    ok = False  # refused early, or the stream broke: the verdict follows
                    break
                if last:
                    state = item[1]
                    break
        except TransferError:  # the feed gave up (no progress): closing the stream aborts the import
            self._close_stream()
            raise
        t1 = time.perf_counter()
        if ok and state is None:  # cancelled: closing the stream makes the receiver abort
            self._close_stream()
            raise TransportClosed("streamed migration cancelled before its final state")
        if ok and self.stream.end():
            final = Final(m.request_id, m.epoch, state)
            self.sock.send_multipart([TOKEN.pack(b"F", token), seal(encode(final))])
        try:
            ack = self._finish(None, early[0] if early else None, ack_header, time.monotonic() + limit)
        except TransferError:
            self._close_stream()
            raise
        t2 = time.perf_counter()
        self.last_phases = {"streamed_ms": (t1 - t0) * 1e3, "exposed_ms": (t2 - t1) * 1e3,
                            "overlap_pct": 100.0 * early_bytes / max(1, m.payload_bytes),
                            **{k: v for k, v in ack.timings.items() if k in RECEIVER_PHASES}}
        return ack

    def migrate(self, manager, seq_id, request_id: str, epoch: int, state=None, *, dedupe: bool = True,
                leases=None, timeout: float | None = None, lease: bool = True) -> Ack:
        """Dedupe query, export, send; see `transport.migrate`."""
        return migrate(self, manager, seq_id, request_id, epoch, state, dedupe=dedupe, leases=leases,
                       timeout=timeout, checksum_mode=self.config.checksum_mode, lease=lease)


def _reply_of(sender, data: bytes, cls):
    return decode_reply(data, cls, sender.config.limits, sender.metrics)
