"""The Ray channel, sending side: the wire's messages (`transfer.wire`, sent as
`message_channel.MessageChannel` sends them, the ZeroMQ channel's way) carried by calls to the
decode worker's actor instead of a socket.

`RayPipe` is used exactly like the ZeroMQ channel's DEALER socket: messages are buffered and go as
one call, `kv(conn, headers, *bodies)` (`ray_receiver`), when the channel waits for an answer or
flushes a streamed transfer's batch; payload chunks are numpy views of pool memory that Ray copies
once into its object store at submission (a staging slot's bytes are copied at once, since the
slot is reused). At most one call is outstanding, so the receiver sees the messages in order;
each call returns the answers the receiver produced for this connection. Every wait is bounded.
A same-node sender offers its /dev/shm pool (`transfer.pull`), so a whole transfer then moves no
payload through the object store at all. `RaySender(fingerprint, actor, config)` is a session
over this channel.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import uuid

import msgpack
import numpy as np

from transfer.channels.message_channel import MessageChannel
from transfer.errors import MalformedMessage, TransferTimeout
from transfer.pull import shm_advert
from transfer.session import SenderSession
from transfer.transport import TransportConfig

MAX_REPLIES = 4096
# each payload chunk is one object-store argument of the call: fewer, larger ones cost less per byte
# (the schema's largest chunk; `pdserve bench migrate`, ray-store row)
CHUNK_BYTES = 16 << 20


def RaySender(fingerprint: dict, actor, config: TransportConfig | None = None, *, metrics=None, faults=None,
              pool=None):
    """A sender session over a Ray channel to `actor`. pool: this side's KVStorage (a /dev/shm pool
    is offered to a same-node receiver, which reads payloads from it). Checksums go in the
    manifest (a whole transfer's pieces may never be touched by this side)."""
    config = config or TransportConfig()
    config = dataclasses.replace(config, checksum_mode="manifest", data_plane="zmq",
                                 chunk_bytes=max(config.chunk_bytes, CHUNK_BYTES))
    channel = RayChannel(actor, config, metrics, shm_advert(pool))
    return SenderSession(fingerprint, config, channel, metrics=metrics, faults=faults)


class RayChannel(MessageChannel):
    """The messages over a `RayPipe` to `actor` (no bulk link: chunks travel in the calls, batched:
    `flush` sends what is queued as one call)."""

    def __init__(self, actor, config: TransportConfig, metrics=None, advert=None):
        super().__init__(config, metrics, advert)
        self.actor = actor
        self._open()

    def _open(self) -> None:
        self.sock = RayPipe(self.actor, self.config.transfer_timeout_s)

    def flush(self) -> None:
        self.sock.flush()


class _Sent:
    """The tracker of a message whose bytes were copied when it was queued."""

    done = True


class RayPipe:
    """A DEALER-like message pipe over one connection's actor calls (`send_multipart`, `poll`,
    `recv_multipart`, `close`)."""

    def __init__(self, actor, call_timeout_s: float):
        self.actor, self.call_timeout_s = actor, call_timeout_s
        self.conn = uuid.uuid4().hex  # this connection, as the receiver knows it
        self.headers: list[bytes] = []
        self.bodies: list = []
        self.pending = None  # the outstanding call
        self.replies: collections.deque = collections.deque()

    def send_multipart(self, parts, copy: bool = True, track: bool = False, flags: int = 0):
        header, body = parts
        if track:  # a staging slot, reused once this returns: its bytes go now
            body = bytes(memoryview(body))
        elif not isinstance(body, bytes):
            body = np.frombuffer(body, dtype=np.uint8)  # a view of pool memory (leased until the ack)
        self.headers.append(bytes(header))
        self.bodies.append(body)
        return _Sent() if track else None

    def flush(self) -> None:
        """Send what is queued as one call, once the previous call has answered."""
        if not self.headers:
            return
        if not self._collect(time.monotonic() + self.call_timeout_s):
            raise TransferTimeout(f"the receiving actor did not answer within {self.call_timeout_s}s")
        self.pending = self._call(msgpack.packb(self.headers, use_bin_type=True), self.bodies)
        self.headers, self.bodies = [], []

    def _call(self, headers: bytes, bodies: list):
        """Start the call carrying one batch of messages: its pending answer."""
        return self.actor.kv.remote(self.conn, headers, *bodies)

    def _collect(self, deadline: float) -> bool:
        """Wait (until `deadline`) for the outstanding call; its answers join `replies`."""
        if self.pending is None:
            return True
        pending, self.pending = self.pending, None  # a call that failed is not waited for again
        data = self._answer(pending, deadline)
        if data is None:
            self.pending = pending  # still running
            return False
        self.replies.extend(_decode_replies(data))
        return True

    def _answer(self, pending, deadline: float) -> bytes | None:
        """The call's answers once it returned by `deadline`, else None."""
        import ray

        ready, _ = ray.wait([pending], timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            return None
        try:
            return ray.get(pending, timeout=self.call_timeout_s)
        except ray.exceptions.RayError as e:  # the actor died or raised
            raise TransferTimeout(f"receiving actor failed: {type(e).__name__}") from None

    def poll(self, timeout_ms: int = 0) -> bool:
        """Whether an answer is waiting; with a timeout, queued messages go first."""
        if self.replies:
            return True
        if timeout_ms:
            self.flush()
        if self.pending is not None:
            self._collect(time.monotonic() + timeout_ms / 1000)
        return bool(self.replies)

    def recv_multipart(self) -> list[bytes]:
        return list(self.replies.popleft())

    def close(self, linger: int = 0) -> None:
        """Queued messages are dropped; an outstanding call is left to finish on its own."""
        self.headers, self.bodies, self.pending = [], [], None
        self.replies.clear()


def _decode_replies(data) -> list[tuple[bytes, bytes]]:
    try:
        out = msgpack.unpackb(data, raw=False, max_array_len=MAX_REPLIES, max_str_len=0, max_map_len=0,
                              max_ext_len=0)
    except Exception as e:  # noqa: BLE001 - msgpack raises many kinds
        raise MalformedMessage(f"the receiver's answers are not msgpack: {type(e).__name__}") from None
    if type(out) is not list or any(type(r) is not list or len(r) != 2 or type(r[0]) is not bytes
                                    or type(r[1]) is not bytes for r in out):
        raise MalformedMessage("the receiver's answers must be [header, body] byte pairs")
    return [(r[0], r[1]) for r in out]
