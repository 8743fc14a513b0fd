"""A receiver's answers before any transfer (`Handshake`, a collaborator every channel's
`transfer.receiver.MessageReceiver` makes with itself): the handshake (`hello`: at most
`PREAUTH_MAX_BYTES`, checked before it is decoded; a signed hello must be addressed to this
receiver, fresh and genuine before anything about the receiver is revealed; every failure up to
there, of any exception type, is a counted refusal that never leaves `poll`; then layouts are
compared, a bulk-link token is issued when the sender asked for one, and the reply is signed for
this hello), the sender's offer of its pool to read payloads from (`pool`, `transfer.pull`) and the
dedupe query (`query`: answered only for an admitted request of the sender's). Owner's thread only.
"""

from __future__ import annotations

from transfer.admission import refused
from transfer.errors import HandshakeRequired, MalformedMessage, TransferError
from transfer.pull import drop_source, open_source
from transfer.reblock import check_compatible
from transfer.refusals import as_refusal
from transfer.transport import authenticate_hello, sign_reply
from transfer.wire import TOKEN, cluster_host
from transfer.wire_codec import decode
from transfer.wire_messages import Held, HelloReply, PoolOffer, PoolReply, Query


class Handshake:
    """The answers before any transfer of receiver `rx` (a `transfer.receiver.MessageReceiver`:
    its message being read, config, fingerprint, admission, pool, connections and answers)."""

    def __init__(self, rx):
        self.rx = rx

    def turn_away(self, ident: bytes, header: bytes, err: TransferError) -> None:
        """Refuse an unauthenticated peer: counted by reason, logged at a bounded rate, nacked."""
        self.rx.refusals.refuse(err.code, str(err))
        return self.rx._nack(ident, header, err, 200)

    def stranger(self, ident: bytes, peer, frame) -> None:
        """A message from a peer without a completed handshake: a hello is checked (`_hello`),
        anything else is refused unread. Nothing raised here leaves `poll`."""
        parts = self.rx.parts
        try:
            header = frame.bytes
            if header != b"H" or not parts.more():
                parts.drain()  # answered under the header the sender waits on (q, A+token), else N
                reply = {b"Q": b"q", b"U": b"u"}.get(header, b"N")
                if len(header) == TOKEN.size and header[:1] in b"MSOEFP":
                    reply = TOKEN.pack(b"A", TOKEN.unpack(header)[1])
                return self.turn_away(ident, reply, HandshakeRequired("no completed handshake"))
            body = parts.next()
            if parts.drain():
                raise MalformedMessage("hello with extra parts")
        except Exception as e:  # noqa: BLE001 - convention 15: before authentication, a refusal
            return self.turn_away(ident, b"h", as_refusal(e))
        return self.hello(ident, peer, body.buffer)  # refuses whatever fails before authentication

    def hello(self, ident: bytes, peer, body) -> None:
        peer.plan = None  # a new handshake replaces the old one, whatever its outcome
        drop_source(peer)
        try:
            hello = authenticate_hello(body, body.nbytes, self.rx.config, self.rx._nonces)
        except TransferError as e:
            return self.turn_away(ident, b"h", e)
        try:  # authenticated from here on: a mismatch is the peer's error, raised as before
            plan = check_compatible(hello.fingerprint, self.rx.fingerprint)
        except TransferError as e:
            self.rx._refuse(ident, b"h", e)
        peer.plan, peer.name = plan, hello.peer
        self.rx.peers.trust(ident, peer)
        if self.rx.idle is not None:
            self.rx.idle.trusted(peer.fd)
        reply = HelloReply(self.rx.fingerprint, self.rx.config.peer_name)
        st = self.rx.bulk
        if st is not None and (hello.stream == "tcp" or (hello.stream == "ipc" and st.path)):
            tcp = hello.stream == "tcp"
            reply = HelloReply(self.rx.fingerprint, self.rx.config.peer_name, st.port if tcp else 0,
                               "" if tcp else st.path, st.issue(ident))
        self.rx._send(ident, b"h", sign_reply(reply, hello, self.rx.config))
        return None

    def pool(self, ident: bytes, peer, body) -> None:
        """A handshaken sender offers its pool to read payloads from (`transfer.pull`)."""
        try:
            offer = decode(body, self.rx.config.limits, PoolOffer)
        except TransferError as e:
            self.rx._refuse(ident, b"u", e)
        drop_source(peer)
        try:
            peer.source = open_source(offer, self.rx.manager.storage, cluster_host(self.rx.config.address))
            reply = PoolReply(True)
        except MalformedMessage as e:  # another node's file, a way this receiver lacks: bytes are pushed
            peer.source, reply = None, PoolReply(False, str(e)[:200])
        self.rx._send(ident, b"u", reply)
        return None

    def query(self, ident: bytes, peer, body) -> None:
        try:
            q = decode(body, self.rx.config.limits, Query)
            if peer.plan is None or not self.rx.admission.admit_query(q.request_id, peer.name):
                raise refused()
            if q.block_size != self.rx.manager.block_size:
                raise MalformedMessage(f"query in blocks of {q.block_size}, not {self.rx.manager.block_size}")
        except TransferError as e:
            self.rx._refuse(ident, b"q", e)
        lookup = self.rx.manager.allocator.lookup
        held = tuple(i for i, h in enumerate(q.hashes) if lookup(h) is not None)
        self.rx._send(ident, b"q", Held(q.request_id, held))
        return None
