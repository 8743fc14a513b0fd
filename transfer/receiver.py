"""The receiving half of the KV migration protocol, written once for every channel.

A `MessageReceiver` holds what the protocol needs: the connections (`peers.PeerTable`: each
sender's handshake, its transfer in progress, its offered pool), the hello and the dedupe query (its
`Handshake`, `receiver_hello`), admission and the import session opened by a manifest, payload
chunks, a streamed transfer's final state, the commit and its ack, cancel, expiry, abort and
supersede by a newer epoch (its `Payloads`, `receiver_transfers`), and the in-flight listing. It
reads one message at a time as `Parts` (header, body, or a chunk's bytes, in the wire format of
`transfer.wire`) and answers through `_deliver(connection, header, body)`. A channel's receiver is
only how messages arrive and leave (`transfer.channels`): `zmq_receiver.ZmqReceiver` (a ROUTER
socket, plus the bulk link's reader threads) and `ray_receiver.RayReceiverEndpoint` (a Ray actor's
calls). Every failure is a typed error: nacked, counted once, and the pool left as it was. The owner's thread
only.
"""

from __future__ import annotations

import time

from transfer.admission import OPEN, refused
from transfer.epochs import EpochGuard
from transfer.errors import (
    FrameCountError,
    HandshakeRequired,
    MalformedMessage,
    TransferError,
    TransferTimeout,
)
from transfer.importer import ImportResult, ImportSession
from transfer.metrics import DEFAULT_METRICS, TransferMetrics
from transfer.peers import Peer, PeerTable
from transfer.pull import drop_source
from transfer.receiver_hello import Handshake
from transfer.receiver_transfers import Payloads
from transfer.refusals import Refusals
from transfer.transport import TransportConfig
from transfer.wire import DATA, TOKEN
from transfer.wire_codec import decode, encode, unseal
from transfer.wire_messages import Manifest, Nack


class Part:
    """One message part held in memory (`ListParts`), read like a ZeroMQ frame."""

    def __init__(self, data):
        self.buffer = memoryview(data).cast("B")

    def __len__(self) -> int:
        return self.buffer.nbytes

    @property
    def bytes(self) -> bytes:
        return self.buffer.tobytes()


class ListParts:
    """The parts of one message that arrived whole (a Ray call's), in order."""

    def __init__(self, parts):
        self.parts, self.i = list(parts), 0

    def more(self) -> bool:
        return self.i < len(self.parts)

    def next(self) -> Part:
        self.i += 1
        return Part(self.parts[self.i - 1])

    def drain(self) -> int:
        n, self.i = len(self.parts) - self.i, len(self.parts)
        return n


class MessageReceiver:
    """The protocol state of one receiver; subclasses move the messages. Its answers before a
    transfer are its `handshake`'s, how transfers end its `payloads`' (collaborators made with it)."""

    bulk = None  # the bulk link's listener (ZeroMQ only)
    idle = None     # unauthenticated connections closed after preauth_s (ZeroMQ only)

    def __init__(self, manager, config: TransportConfig | None = None, *, epochs: EpochGuard | None = None,
                 metrics: TransferMetrics | None = None, stage: bool = False, admission=OPEN,
                 clock=time.monotonic):
        """clock: the time transfers expire by (`_expire`; a virtual one in the simulation, `dst`)."""
        config = config or TransportConfig()
        self.clock = clock
        self.manager, self.config, self.stage, self.admission = manager, config, stage, admission
        self.epochs, self.metrics = epochs if epochs is not None else EpochGuard(), metrics or DEFAULT_METRICS
        self.active: dict[bytes, Peer] = {}  # the peers with a transfer in progress
        self.peers = PeerTable(self.active, config.preauth_s)
        self.refusals = Refusals(self.metrics, config.peer_name or config.address)
        self.fingerprint = manager.storage.layout.fingerprint()
        self._nonces: dict[str, float] = {}  # handshake nonces seen recently (no replays)
        self.handshake, self.payloads = Handshake(self), Payloads(self)

    # ---- what a channel's receiver provides -------------------------------------------------------
    def _deliver(self, ident: bytes, header: bytes, body: bytes) -> None:
        raise NotImplementedError

    # ---- transfer.channel.ReceiverEndpoint --------------------------------------------------------
    def abort_request(self, request_id: str) -> int:
        """End the transfers of `request_id` still in flight (`Payloads.abort_request`); how many."""
        return self.payloads.abort_request(request_id)

    def in_flight(self) -> dict[str, list[int]]:
        """Transfer id -> receiver blocks reserved by an import still landing (not yet committed)."""
        return {p.session.manifest.request_id: list(p.session.dst_blocks) for p in self.active.values()}

    def _forget_all(self) -> None:
        """Every transfer ended (blocks returned) and every offered pool closed: the receiver stops."""
        for p in self.peers.values():
            s = self._stop(p)
            if s is not None:
                s.abort()
            drop_source(p)

    def _stop(self, peer: Peer):
        """End the peer's transfer here: its landing's reader stopped, its session (returned) dropped."""
        if peer.landing is not None:  # NOTE: its reader stops before the blocks are freed
            self.bulk.cancel(peer.landing)
            peer.landing = None
        s, peer.session = peer.session, None
        return s

    # ---- answers ----------------------------------------------------------------------------------
    def _send(self, ident: bytes, header: bytes, msg) -> None:
        self._deliver(ident, header, encode(msg))

    def _fail(self, ident: bytes, peer: Peer, err: TransferError):
        """Abort the peer's transfer (if any), nack it, count the error once, and raise it."""
        s = self._stop(peer)
        if s is None:
            self.metrics.record_error(err)
        else:
            s.abort(err)  # counts unless the session already counted a failure
            self._send(ident, TOKEN.pack(b"A", peer.token), Nack(s.manifest.request_id, s.manifest.epoch,
                                                                 err.code, str(err)))
        raise err

    def _nack(self, ident: bytes, header: bytes, err: TransferError, limit: int | None = None) -> None:
        """Count `err` and answer it with a nack naming no transfer (its text cut to `limit`)."""
        self.metrics.record_error(err)
        self._send(ident, header, Nack("", 0, err.code, str(err)[:limit]))

    def _refuse(self, ident: bytes, header: bytes, err: TransferError):
        self._nack(ident, header, err)
        raise err

    def _expire(self) -> None:
        now = self.clock()
        for ident, p in list(self.active.items()):
            session, cfg = p.session, self.config
            silent, age = now - session.last_activity, now - session.started
            if silent > cfg.idle_timeout_s or age > cfg.max_transfer_s:
                why = f"silent for {silent:.1f}s" if silent > cfg.idle_timeout_s else f"running {age:.1f}s"
                self._fail(ident, p, TransferTimeout(f"request {session.manifest.request_id!r}: {why}"))

    def _dispatch(self, ident: bytes, peer: Peer, parts) -> ImportResult | None:
        """One message from connection `ident`, its parts after the identity (`parts`: the
        channel's reader: ZeroMQ frames, or a Ray call's arguments)."""
        self.parts = parts
        if not parts.more():
            return None
        frame = parts.next()
        if peer.plan is None and peer.session is None:  # NOTE: nothing but a hello is read before one
            return self.handshake.stranger(ident, peer, frame)
        if len(frame) > 64:
            parts.drain()
            return self._garbled(ident, peer, MalformedMessage(f"header of {len(frame)} bytes"))
        header = frame.bytes
        if not parts.more():
            return self._garbled(ident, peer, MalformedMessage("message without a body"))
        kind = header[:1]
        if kind == b"D":
            if len(header) != DATA.size:
                parts.drain()
                return self._garbled(ident, peer, MalformedMessage("bad data header"))
            _, token, f, c, cs = DATA.unpack(header)
            if peer.session is None or token != peer.token or peer.landing is not None:
                parts.drain()
                self.metrics.add("stray_chunks")
                return None
            return self.payloads.chunk(ident, peer, f, c, cs)
        body = parts.next().buffer
        if parts.drain():
            return self._garbled(ident, peer, MalformedMessage("message with extra parts"))
        if kind == b"H" and len(header) == 1:
            return self.handshake.hello(ident, peer, body)
        if kind in (b"Q", b"U") and len(header) == 1:
            return (self.handshake.query if kind == b"Q" else self.handshake.pool)(ident, peer, body)
        if kind in b"MSOWEFPKC" and len(header) == TOKEN.size:
            token = TOKEN.unpack(header)[1]
            payloads = self.payloads
            if kind == b"E":
                return payloads.end(ident, peer, token)
            if kind == b"P":
                return payloads.pull(ident, peer, token, body)
            if kind == b"K":
                return payloads.sums(ident, peer, token, body)
            if kind == b"C":
                return payloads.cancel(ident, peer, token)
            if kind == b"F":
                return payloads.final(ident, peer, token, body)
            if kind in (b"M", b"W") or self.bulk is None:
                self._manifest(ident, peer, token, body, streamed=kind in (b"S", b"O"))
                peer.awaits_final = kind == b"W" and peer.session is not None  # chunks here, then "F"
                return None
            try:
                self._manifest(ident, peer, token, body, streamed=True)
                peer.awaits_final = kind == b"O"  # offered before its prompt finished computing
                return None
            except TransferError:
                self.bulk.refuse(ident, token)  # its payload, already on the way, is not awaited
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
        self.payloads.supersede(m)
        if streamed and self.bulk is None:
            return self._refuse(ident, header, MalformedMessage("no bulk link here"))
        try:
            session = ImportSession(self.manager, m, peer.plan, epochs=self.epochs, metrics=self.metrics,
                                    stage=self.stage, make_room=getattr(self.admission, "make_room", None),
                                    local_dedupe_bytes=self.config.inline_bytes, clock=self.clock)
        except TransferError as e:
            self._send(ident, header, Nack(m.request_id, m.epoch, e.code, str(e)))
            raise
        peer.session, peer.token, peer.t0 = session, token, time.perf_counter()
        peer.final, peer.awaits_final, peer.landed, peer.pulled = None, False, False, None
        if streamed:
            peer.landing = self.bulk.expect(ident, token, session)
        return None
