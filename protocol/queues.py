"""Typed ZeroMQ queues: every socket of the worker protocol is one of these two classes.

`PushQueue(address, create)` sends protocol messages (encoded by `protocol.codec`) and never
blocks longer than its send timeout; `PullQueue(address, create)` receives and decodes them on
an asyncio loop. `create=True` binds (port 0 picks a free one; `address` then reports it),
`create=False` connects. A message that does not decode is counted and dropped, never raised
into the reader's loop.
"""

from __future__ import annotations

import logging

import zmq
import zmq.asyncio

import protocol.messages  # noqa: F401  (registers the message classes with the codec)
from protocol.codec import ProtocolError, decode, encode
from protocol.curve import ClusterKeys, connect_curve, serve_curve

log = logging.getLogger(__name__)


def _bind(sock, address: str) -> str:
    if address.startswith("tcp://") and address.endswith(":0"):
        port = sock.bind_to_random_port(address[:-2])
        return f"{address[:-2]}:{port}"
    sock.bind(address)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class PushQueue:
    """Send typed messages; used from one thread. keys: connect as a CURVE client of a report
    socket that holds the cluster keys (protocol.curve)."""

    def __init__(self, address: str, create: bool = False, send_timeout_s: float = 5.0,
                 keys: ClusterKeys | None = None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
        if keys is not None:
            connect_curve(self.sock, keys)
        self.address = _bind(self.sock, address) if create else address
        if not create:
            self.sock.connect(address)

    def put(self, msg) -> bool:
        """False when the peer did not take it within the send timeout (dropped, logged)."""
        try:
            self.sock.send(encode(msg))
            return True
        except zmq.Again:
            log.warning("push to %s timed out; %s dropped", self.address, type(msg).__name__)
            return False

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


class PullQueue:
    """Receive typed messages on an asyncio loop. keys: be a CURVE server that admits only
    clients holding the cluster keys (anyone else cannot connect, let alone forge a report)."""

    def __init__(self, address: str, create: bool = True, expect: type | tuple[type, ...] | None = None,
                 keys: ClusterKeys | None = None):
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.authenticator = None
        if keys is not None:
            from zmq.auth.asyncio import AsyncioAuthenticator

            self.authenticator = serve_curve(self.sock, keys, AsyncioAuthenticator)
        self.address = _bind(self.sock, address) if create else address
        if not create:
            self.sock.connect(address)
        self.expect = expect
        self.dropped = 0

    async def get(self):
        """The next message that decodes (malformed ones are counted in `dropped` and skipped)."""
        while True:
            data = await self.sock.recv()
            try:
                return decode(data, self.expect)
            except ProtocolError as e:
                self.dropped += 1
                log.warning("dropped a malformed message on %s: %s", self.address, e)

    def close(self) -> None:
        if self.authenticator is not None:
            self.authenticator.stop()
        self.sock.close(0)
        self.ctx.term()
