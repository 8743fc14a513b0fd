"""ZeroMQ receiver (decode side): a ROUTER socket serving handshakes and dedupe queries
(`zmq_handshake`) and imports into one pool (their ends: `zmq_payload`); the wire format is in
`transfer.zmq_wire`. Payloads land in the reserved blocks from the data stream's reader threads
(`stream_receiver`) or, for small ones and data_plane "zmq", from this socket. A failed
transfer is aborted (reservation released), nacked, counted, and its error raised from `poll`.
Manifests and dedupe queries pass `admission` (transfer.admission) before anything is allocated.
A peer without a completed handshake gets nothing but its hello read (`transfer.refusals`: size
checked before decoding, every error a counted refusal that never escapes `poll`); its state and
its connection are dropped after `preauth_s` (`transfer.zmq_peers`).
"""

from __future__ import annotations

import contextlib
import math
import os
import time

import zmq

from transfer.admission import OPEN, refused
from transfer.codec import decode, encode, unseal
from transfer.epochs import EpochGuard
from transfer.errors import (
    FrameCountError,
    HandshakeRequired,
    MalformedMessage,
    TransferError,
    TransferTimeout,
)
from transfer.importer import ImportResult, ImportSession
from transfer.messages import Manifest, Nack
from transfer.metrics import DEFAULT_METRICS, TransferMetrics
from transfer.pull import drop_source
from transfer.refusals import Refusals
from transfer.stream_receiver import StreamListener
from transfer.stream_wire import parse_address
from transfer.transport import TransportConfig
from transfer.wakeup import Wakeup
from transfer.zmq_handshake import HandshakeMixin
from transfer.zmq_payload import PayloadMixin
from transfer.zmq_peers import IdleConnections, Peer, PeerTable
from transfer.zmq_wire import DATA, TOKEN, bind_address


class ZmqReceiver(HandshakeMixin, PayloadMixin):
    """Decode side: serves handshakes, dedupe queries and imports into `manager`'s pool."""

    def __init__(self, manager, config: TransportConfig | None = None, *, epochs: EpochGuard | None = None,
                 metrics: TransferMetrics | None = None, stage: bool = False, admission=OPEN):
        config = config or TransportConfig()
        self.manager, self.config, self.stage, self.admission = manager, config, stage, admission
        self.epochs, self.metrics = epochs if epochs is not None else EpochGuard(), metrics or DEFAULT_METRICS
        self.ctx = zmq.Context(io_threads=config.io_threads)
        s = self.sock = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, config.rcvhwm)
        if config.socket_buffer_bytes:
            s.setsockopt(zmq.RCVBUF, config.socket_buffer_bytes)
            s.setsockopt(zmq.SNDBUF, config.socket_buffer_bytes)
        s.setsockopt(zmq.MAXMSGSIZE, max(config.limits.max_chunk_bytes, config.limits.max_message_bytes) + 64)
        s.bind(bind_address(config.address))
        self.address = s.getsockopt_string(zmq.LAST_ENDPOINT)
        self._bound = [self.address]
        self.active: dict[bytes, Peer] = {}  # the peers with a transfer in progress
        self.peers = PeerTable(self.active, config.preauth_s)
        self.refusals = Refusals(self.metrics, config.peer_name or self.address)
        self.idle = IdleConnections(s, config.preauth_s, self.refusals)  # closes them after preauth_s
        self.fingerprint = manager.storage.layout.fingerprint()
        self._nonces: dict[str, float] = {}  # handshake nonces seen recently (no replays)
        self.poller = zmq.Poller()
        self.poller.register(s, zmq.POLLIN)
        self.wakeup = Wakeup()
        self.poller.register(self.wakeup.fd, zmq.POLLIN)
        self.streams: StreamListener | None = None
        if config.data_plane == "stream":
            scheme, where = parse_address(self.address)
            self.streams = StreamListener(where if scheme == "tcp" else "127.0.0.1", config, self.metrics,
                                          self.refusals)
            if scheme == "ipc":
                self.streams.listen_unix(where + ".data")
            self.poller.register(self.streams.wake_fd, zmq.POLLIN)

    # ---- public -----------------------------------------------------------------------------
    def bind(self, address: str) -> str:
        """Also accept connections at another endpoint (e.g. ipc:// beside tcp://); returns it."""
        self.sock.bind(bind_address(address))
        self._bound.append(self.sock.getsockopt_string(zmq.LAST_ENDPOINT))
        if self.streams is not None and address.startswith("ipc://") and not self.streams.path:
            self.streams.listen_unix(address[len("ipc://"):] + ".data")
        return self._bound[-1]

    def poll(self, timeout: float) -> ImportResult | None:
        """Serve until an import commits (returned), one fails (its error raised), `timeout` passes or
        `wake()` is called (None)."""
        deadline = time.monotonic() + timeout
        while True:
            result = self._landed()
            if result is not None:
                return result
            self._expire()
            now = time.monotonic()
            if now >= self.idle.next_sweep:  # unauthenticated state and connections past their bound
                self.idle.next_sweep = now + min(1.0, self.config.preauth_s / 4)
                self.peers.sweep(now)
                self.idle.sweep(now)
            if now >= deadline:
                return None
            wait = deadline - now
            idle = [p.session.last_activity + self.config.idle_timeout_s - now
                    for p in self.active.values()]
            if idle:
                wait = min(wait, max(0.0, min(idle)))
            if self.streams is not None and not self.streams.finished.empty():
                wait = 0.0
            ready = dict(self.poller.poll(math.ceil(wait * 1000)))
            if self.sock in ready:
                result = self._handle()
                if result is not None:
                    return result
            if self.wakeup.fd in ready:  # woken for the owner (a queued command)
                self.wakeup.clear()
                return None

    def wake(self) -> None:
        """Any thread: end the owner's `poll` now (returning None if nothing committed)."""
        self.wakeup.set()

    def in_flight(self) -> dict[str, list[int]]:
        """Transfer id -> receiver blocks reserved by an import still landing (not yet committed)."""
        return {p.session.manifest.request_id: list(p.session.dst_blocks) for p in self.active.values()}

    def close(self) -> None:
        for p in self.peers.values():
            if p.landing is not None:  # NOTE: its reader stops before the blocks are freed
                self.streams.cancel(p.landing)
                p.landing = None
            if p.session is not None:
                p.session.abort()
                p.session = None
            drop_source(p)
        if self.streams is not None:
            self.streams.close()
        self.idle.close()
        self.sock.close(0)
        self.ctx.term()
        self.wakeup.close()
        for endpoint in self._bound:  # ZeroMQ leaves ipc:// socket files behind
            if endpoint.startswith("ipc://"):
                with contextlib.suppress(OSError):
                    os.unlink(endpoint[len("ipc://"):])

    # ---- message handling -------------------------------------------------------------------
    def _more(self) -> bool:
        return bool(self.sock.getsockopt(zmq.RCVMORE))

    def _drain(self) -> int:
        n = 0
        while self._more():
            self.sock.recv(copy=False)
            n += 1
        return n

    def _send(self, ident: bytes, header: bytes, msg) -> None:
        try:
            self.sock.send_multipart([ident, header, encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            self.metrics.add("replies_dropped")

    def _fail(self, ident: bytes, peer: Peer, err: TransferError, counted: bool = False):
        """Abort the peer's transfer (if any), nack it, count the error once, and raise it."""
        s, peer.session = peer.session, None
        if peer.landing is not None:  # NOTE: its reader stops before the blocks are freed
            self.streams.cancel(peer.landing)
            peer.landing = None
        if s is not None:
            s.abort(err)  # counts unless the session already counted a failure
            self._send(ident, TOKEN.pack(b"A", peer.token), Nack(s.manifest.request_id, s.manifest.epoch,
                                                                 err.code, str(err)))
        elif not counted:
            self.metrics.record_error(err)
        raise err

    def _refuse(self, ident: bytes, header: bytes, err: TransferError, counted: bool = False):
        if not counted:
            self.metrics.record_error(err)
        self._send(ident, header, Nack("", 0, err.code, str(err)))
        raise err

    def _expire(self) -> None:
        now = time.monotonic()
        for ident, p in list(self.active.items()):
            session, cfg = p.session, self.config
            silent, age = now - session.last_activity, now - session.started
            if silent > cfg.idle_timeout_s or age > cfg.max_transfer_s:
                why = f"silent for {silent:.1f}s" if silent > cfg.idle_timeout_s else f"running {age:.1f}s"
                self._fail(ident, p, TransferTimeout(f"request {session.manifest.request_id!r}: {why}"))

    def _handle(self) -> ImportResult | None:
        sock = self.sock
        first = sock.recv(copy=False)
        ident = first.bytes
        if not self._more():
            return None
        frame = sock.recv(copy=False)
        peer = self.peers.get(ident)
        if peer.plan is None and peer.session is None:  # NOTE: nothing but a hello is read before one
            return self._stranger(ident, peer, first, frame)
        if len(frame) > 64:
            self._drain()
            return self._garbled(ident, peer, MalformedMessage(f"header of {len(frame)} bytes"))
        header = frame.bytes
        if not self._more():
            return self._garbled(ident, peer, MalformedMessage("message without a body"))
        kind = header[:1]
        if kind == b"D":
            if len(header) != DATA.size:
                self._drain()
                return self._garbled(ident, peer, MalformedMessage("bad data header"))
            _, token, f, c, cs = DATA.unpack(header)
            if peer.session is None or token != peer.token or peer.landing is not None:
                self._drain()
                self.metrics.add("stray_chunks")
                return None
            return self._chunk(ident, peer, f, c, cs)
        body = sock.recv(copy=False).buffer
        if self._drain():
            return self._garbled(ident, peer, MalformedMessage("message with extra parts"))
        if kind == b"H" and len(header) == 1:
            return self._hello(ident, peer, body)
        if kind in (b"Q", b"U") and len(header) == 1:
            return (self._query if kind == b"Q" else self._pool)(ident, peer, body)
        if kind in (b"M", b"S", b"O", b"E", b"F", b"P") and len(header) == TOKEN.size:
            token = TOKEN.unpack(header)[1]
            if kind in (b"E", b"P"):
                return self._end(ident, peer, token) if kind == b"E" else self._pull(ident, peer, token, body)
            if kind == b"F":
                return self._final(ident, peer, token, body)
            if kind == b"M" or self.streams is None:
                return self._manifest(ident, peer, token, body, streamed=kind != b"M")
            try:
                self._manifest(ident, peer, token, body, streamed=True)
                peer.awaits_final = kind == b"O"  # offered before its prompt finished computing
                return None
            except TransferError:
                self.streams.refuse(ident, token)  # its payload, already on the way, is not awaited
                raise
        return self._garbled(ident, peer, MalformedMessage(f"unknown message header {bytes(header[:16])!r}"))

    def _garbled(self, ident: bytes, peer: Peer, err: TransferError):
        if peer.session is not None:
            return self._fail(ident, peer, err)
        return self._refuse(ident, b"N", err)

    def _manifest(self, ident: bytes, peer: Peer, token: int, body, streamed: bool = False) -> None:
        header = TOKEN.pack(b"A", token)
        if token == peer.token:  # a duplicated manifest: served, refused or being served already
            self.metrics.add("duplicate_manifests")
            return None
        if peer.session is not None:  # the previous transfer never ended: abandon it, keep serving
            try:
                self._fail(ident, peer, FrameCountError("new manifest before the previous transfer ended"))
            except TransferError:
                pass
        peer.token = token  # a repeat of this manifest is a duplicate from now on, refused or not
        if peer.plan is None:  # NOTE: refused unread
            return self._refuse(ident, header, HandshakeRequired("manifest before a completed handshake"))
        try:
            m = decode(unseal(body), self.config.limits, Manifest)
        except TransferError as e:
            return self._refuse(ident, header, e)
        if not self.admission.admit_transfer(m.request_id, m.epoch, peer.name):
            return self._refuse(ident, header, refused())  # NOTE: before any block is allocated
        self._supersede(m)
        if streamed and self.streams is None:
            return self._refuse(ident, header, MalformedMessage("no data stream here"))
        try:
            session = ImportSession(self.manager, m, peer.plan, epochs=self.epochs, metrics=self.metrics,
                                    stage=self.stage, make_room=getattr(self.admission, "make_room", None),
                                    local_dedupe_bytes=self.config.inline_bytes)
        except TransferError as e:
            self._send(ident, header, Nack(m.request_id, m.epoch, e.code, str(e)))
            raise
        peer.session, peer.token, peer.t0 = session, token, time.perf_counter()
        peer.final, peer.awaits_final, peer.landed = None, False, False
        if streamed:
            peer.landing = self.streams.expect(ident, token, session)
        return None
