"""The ZeroMQ receiver's answers before any transfer, as a mixin of `ZmqReceiver`: the handshake
(`_hello`: a signed hello is checked before anything about the receiver is revealed, layouts are
compared, and a data-stream token is issued when the sender asked for one) and the dedupe query
(`_query`: answered only for an admitted request of the sender's). Owner's thread only.
"""

from __future__ import annotations

from transfer.admission import refused
from transfer.codec import decode
from transfer.errors import MalformedMessage, TransferError
from transfer.messages import Held, Hello, HelloReply, Query
from transfer.reblock import check_compatible
from transfer.transport import hello_is_genuine


class HandshakeMixin:
    """Needs from the host class: config, fingerprint, admission, manager, streams, _nonces, _send,
    _refuse."""

    def _hello(self, ident: bytes, peer, body) -> None:
        try:
            hello = decode(body, self.config.limits, Hello)
            if not hello_is_genuine(hello, self.config, self._nonces):
                raise refused()  # NOTE: before anything about this receiver is revealed
            peer.plan = check_compatible(hello.fingerprint, self.fingerprint)
        except TransferError as e:
            peer.plan = None
            self._refuse(ident, b"h", e)
        peer.name = hello.peer
        reply = HelloReply(self.fingerprint, self.config.peer_name)
        st = self.streams
        if st is not None and (hello.stream == "tcp" or (hello.stream == "ipc" and st.path)):
            tcp = hello.stream == "tcp"
            reply = HelloReply(self.fingerprint, self.config.peer_name, st.port if tcp else 0,
                               "" if tcp else st.path, st.issue(ident))
        self._send(ident, b"h", reply)
        return None

    def _query(self, ident: bytes, peer, body) -> None:
        try:
            q = decode(body, self.config.limits, Query)
            if peer.plan is None or not self.admission.admit_query(q.request_id, peer.name):
                raise refused()
            if q.block_size != self.manager.block_size:
                raise MalformedMessage(f"query in blocks of {q.block_size}, not {self.manager.block_size}")
        except TransferError as e:
            self._refuse(ident, b"q", e)
        lookup = self.manager.allocator.lookup
        held = tuple(i for i, h in enumerate(q.hashes) if lookup(h) is not None)
        self._send(ident, b"q", Held(q.request_id, held))
        return None
