"""The Ray receiver's answers before any transfer, as a mixin of `RayReceiverEndpoint`: the
handshake (`kv_hello`) and the dedupe query (`kv_query`), with the ZeroMQ receiver's rules
(`zmq_handshake`, `transfer.refusals`): a hello of more than `PREAUTH_MAX_BYTES` is refused
unread; a signed one must be addressed to this receiver, fresh and genuine before anything is
revealed; every failure up to there, of any exception type, is a counted, rate-logged refusal
answered by a detail-free nack, never an exception in the owner's loop; the reply is signed for
the hello it answers. A query (and every other call) on a connection without a completed
handshake is refused before its bytes are decoded. The owner's thread only.
"""

from __future__ import annotations

from transfer.admission import refused
from transfer.codec import decode, encode
from transfer.errors import HandshakeRequired, MalformedMessage, TransferError
from transfer.messages import Held, HelloReply, Nack
from transfer.ray_shm import open_peer_pool
from transfer.reblock import check_compatible
from transfer.transport import authenticate_hello, sign_reply

MAX_CONNECTIONS = 4096  # handshaken connections remembered (the oldest forgotten first)


class RayHandshakeMixin:
    """Needs from the host class: config, fingerprint, admission, manager, metrics, refusals,
    plans, pools, _nonces, _nack."""

    def _turn_away(self, err: TransferError) -> bytes:
        self.metrics.record_error(err)
        self.refusals.refuse(err.code, str(err))
        return encode(Nack("", 0, err.code, str(err)[:200]))

    def kv_hello(self, conn: str, data: bytes) -> bytes:
        try:
            conn = str(conn)[:128]
            hello = authenticate_hello(data, len(memoryview(data).cast("B")), self.config, self._nonces)
        except TransferError as e:
            return self._turn_away(e)
        try:  # authenticated from here on
            plan = check_compatible(hello.fingerprint, self.fingerprint)
        except TransferError as e:
            return self._nack(e)
        if conn not in self.plans and len(self.plans) >= MAX_CONNECTIONS:
            oldest = next(iter(self.plans))
            self.plans.pop(oldest)
            self.pools.pop(oldest, None)
        self.plans[conn] = (plan, hello.peer)
        pool = open_peer_pool(hello.pool_path)
        if pool is not None:
            self.pools[conn] = pool
        path = pool.path if pool is not None else ""
        return encode(sign_reply(HelloReply(self.fingerprint, self.config.peer_name, data_path=path), hello,
                                 self.config))

    def handshaken(self, conn) -> tuple | None:
        """(plan, sender's name) of a connection with a completed handshake, else None; never raises."""
        try:
            return self.plans.get(str(conn)[:128])
        except Exception:  # noqa: BLE001 - a peer's object whose str() fails: no handshake
            return None

    def kv_query(self, conn: str, data: bytes) -> bytes:
        entry = self.handshaken(conn)
        if entry is None:  # NOTE: refused unread
            return self._turn_away(HandshakeRequired("dedupe query before a completed handshake"))
        try:
            from transfer.messages import Query

            q = decode(data, self.config.limits, Query)
            if not self.admission.admit_query(q.request_id, entry[1]):
                raise refused()
            if q.block_size != self.manager.block_size:
                raise MalformedMessage(f"query in blocks of {q.block_size}, not {self.manager.block_size}")
        except TransferError as e:
            return self._nack(e)
        lookup = self.manager.allocator.lookup
        return encode(Held(q.request_id, tuple(i for i, h in enumerate(q.hashes) if lookup(h) is not None)))
