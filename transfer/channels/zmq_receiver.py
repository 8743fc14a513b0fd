"""ZeroMQ receiver (decode side): the protocol of `transfer.receiver.MessageReceiver` served on a
ROUTER socket (wire format: `transfer.wire`) and the bulk link beside it. Payloads land
in the reserved blocks from the bulk link's reader threads (`bulk_receiver`) or, for small
ones and data_plane "zmq", from this socket. A failed transfer is aborted (reservation
released), nacked, counted, and its error raised from `poll`. A peer without a completed
handshake gets nothing but its hello read, and its connection is closed after `preauth_s`
(`transfer.channels.zmq_peers`). With a cluster secret the socket is a CURVE server that admits only the
key pair derived from it (`protocol.curve.kv_keys`): a peer without the secret never completes
the ZeroMQ handshake, so libzmq drops it after its 64-byte greeting (or its first handshake
command) and never buffers a message of its, however many frames it announces (issue 49).
"""

from __future__ import annotations

import contextlib
import math
import os
import time

import zmq

from protocol.curve import kv_keys, serve_curve
from transfer.channels.bulk_receiver import BulkListener
from transfer.channels.zmq_peers import IdleConnections
from transfer.importer import ImportResult
from transfer.receiver import MessageReceiver
from transfer.refusals import Refusals
from transfer.transport import TransportConfig
from transfer.wakeup import Wakeup
from transfer.wire import bind_address, parse_address


class ZmqReceiver(MessageReceiver):
    """Decode side: serves handshakes, dedupe queries and imports into `manager`'s pool."""

    def __init__(self, manager, config: TransportConfig | None = None, **kwargs):
        """kwargs: MessageReceiver's (epochs, metrics, stage, admission)."""
        super().__init__(manager, config, **kwargs)
        config = self.config
        self.ctx = zmq.Context(io_threads=config.io_threads)
        s = self.sock = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, config.rcvhwm)
        if config.socket_buffer_bytes:
            s.setsockopt(zmq.RCVBUF, config.socket_buffer_bytes)
            s.setsockopt(zmq.SNDBUF, config.socket_buffer_bytes)
        s.setsockopt(zmq.MAXMSGSIZE, max(config.limits.max_chunk_bytes, config.limits.max_message_bytes) + 64)
        s.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(config.preauth_s * 1000)))  # ZeroMQ's own handshake
        self.authenticator = None
        try:
            if config.secret:  # only cluster members complete the ZeroMQ handshake
                from zmq.auth.thread import ThreadAuthenticator

                self.authenticator = serve_curve(s, kv_keys(config.secret), ThreadAuthenticator)
            s.bind(bind_address(config.address))
        except BaseException:
            # NOTE: a port taken (make_receiver then tries the next) must not leave the socket, the
            # authenticator's thread and the context behind: the context's collection would block
            # in term() on the authenticator's socket, hanging whatever thread collects it
            if self.authenticator is not None:
                self.authenticator.stop()
            s.close(0)
            self.ctx.term()
            raise
        self.address = s.getsockopt_string(zmq.LAST_ENDPOINT)
        self._bound = [self.address]
        self.refusals = Refusals(self.metrics, config.peer_name or self.address)
        self.idle = IdleConnections(s, config.preauth_s, self.refusals)  # closes them after preauth_s
        self.poller = zmq.Poller()
        self.poller.register(s, zmq.POLLIN)
        self.wakeup = Wakeup()
        self.poller.register(self.wakeup.fd, zmq.POLLIN)
        self.bulk: BulkListener | None = None
        if config.data_plane == "stream":
            scheme, where = parse_address(self.address)
            self.bulk = BulkListener(where if scheme == "tcp" else "127.0.0.1", config, self.metrics,
                                          self.refusals)
            if scheme == "ipc":
                self.bulk.listen_unix(where + ".data")
            self.poller.register(self.bulk.wake.fd, zmq.POLLIN)

    # ---- public -----------------------------------------------------------------------------
    def bind(self, address: str) -> str:
        """Also accept connections at another endpoint (e.g. ipc:// beside tcp://); returns it."""
        self.sock.bind(bind_address(address))
        self._bound.append(self.sock.getsockopt_string(zmq.LAST_ENDPOINT))
        if self.bulk is not None and address.startswith("ipc://") and not self.bulk.path:
            self.bulk.listen_unix(address[len("ipc://"):] + ".data")
        return self._bound[-1]

    def poll(self, timeout: float) -> ImportResult | None:
        """Serve until an import commits (returned), one fails (its error raised), `timeout` passes or
        `wake()` is called (None)."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.payloads.commit_landed()
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
            if self.bulk is not None and not self.bulk.finished.empty():
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

    def close(self) -> None:
        self._forget_all()
        if self.bulk is not None:
            self.bulk.close()
        self.idle.close()
        self.sock.close(0)
        if self.authenticator is not None:
            self.authenticator.stop()
        self.ctx.term()
        self.wakeup.close()
        for endpoint in self._bound:  # ZeroMQ leaves ipc:// socket files behind
            if endpoint.startswith("ipc://"):
                with contextlib.suppress(OSError):
                    os.unlink(endpoint[len("ipc://"):])

    # ---- message handling -------------------------------------------------------------------
    def _deliver(self, ident: bytes, header: bytes, body: bytes) -> None:
        try:
            self.sock.send_multipart([ident, header, body], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            self.metrics.add("replies_dropped")

    def _handle(self) -> ImportResult | None:
        first = self.sock.recv(copy=False)
        ident = first.bytes
        peer = self.peers.get(ident)
        if peer.plan is None:
            with contextlib.suppress(zmq.ZMQError):
                peer.fd = first.get(zmq.SRCFD)  # its connection: trusted once a hello passes (zmq_peers)
        return self._dispatch(ident, peer, ZmqParts(self.sock))


class ZmqParts:
    """The rest of the message being read from the ROUTER socket, part by part."""

    def __init__(self, sock):
        self.sock = sock

    def more(self) -> bool:
        return bool(self.sock.getsockopt(zmq.RCVMORE))

    def next(self):
        return self.sock.recv(copy=False)

    def drain(self) -> int:
        n = 0
        while self.more():
            self.sock.recv(copy=False)
            n += 1
        return n
