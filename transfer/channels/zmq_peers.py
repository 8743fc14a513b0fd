"""How a ZeroMQ receiver closes connections that never complete a handshake (ARCHITECTURE.md,
convention 15; the peers' state itself is `transfer.peers`). `IdleConnections` follows the
ROUTER's accepted and closed connections through a socket monitor and shuts down, below ZeroMQ,
every one that has not completed a handshake `preauth_s` after it was accepted (ZeroMQ has no call
to drop one peer of a ROUTER; a shut-down socket is closed by its I/O thread as if the peer had
hung up). It also counts the connections libzmq itself dropped in its handshake (a peer without
the cluster's CURVE key: `zmq_receiver`) as "curve" refusals.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from transfer.channels.zmq_handshake import describe

HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class IdleConnections:
    """Closes a ROUTER's connections that complete no handshake within `bound_s` of being accepted."""

    def __init__(self, sock, bound_s: float, refusals):
        self.sock, self.bound_s, self.refusals = sock, bound_s, refusals
        self.monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED)
        self.pending: dict[int, tuple[float, object]] = {}  # fd -> (accepted at, its peer address)
        self.trust: dict[int, object] = {}  # fd -> address of the last handshaken connection on it
        self.next_sweep = 0.0

    def trusted(self, fd: int) -> None:
        """The connection on `fd` completed a handshake: it stays open. (Its accept event may come
        through the monitor only later: the peer address tells the same connection apart.)"""
        self._events()
        self.pending.pop(fd, None)
        if fd >= 0:
            self.trust[fd] = _peer_of(fd)

    def sweep(self, now: float) -> None:
        """Shut down the connections past the bound."""
        self._events()
        for fd, (t, peer) in list(self.pending.items()):
            if now - t <= self.bound_s:
                continue
            del self.pending[fd]
            if self.trust.get(fd) == peer:  # handshaken before its accept event came through
                continue
            if _shutdown(fd, peer):
                self.refusals.refuse("idle_preauth", f"no handshake after {self.bound_s}s: closed")

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.monitor.close(0)

    def _events(self) -> None:
        while self.monitor.poll(0):
            try:
                event = parse_monitor_message(self.monitor.recv_multipart())
            except (zmq.ZMQError, ValueError):
                continue
            fd = event["value"]
            if event["event"] & HANDSHAKE_FAILED:  # its value is an error code; a disconnect follows
                self.refusals.refuse("curve", f"ZeroMQ handshake failed: {describe(event)}")
            elif event["event"] == zmq.EVENT_ACCEPTED:
                self.pending[fd] = (time.monotonic(), _peer_of(fd))
            else:  # `trust` keeps its entry: the address tells a reused descriptor apart
                self.pending.pop(fd, None)


def _shutdown(fd: int, peer) -> bool:
    """Shut the connection on `fd` down if it is still the one accepted (same remote address)."""
    return peer is not None and _peer_of(fd, shut_if=peer) == peer


def _peer_of(fd: int, shut_if=None):
    """The remote address of the socket on `fd` (None if it is gone), to tell a reused descriptor;
    the connection is shut down when that address is `shut_if`."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        peer = s.getpeername()
        if shut_if is not None and peer == shut_if:
            s.shutdown(socket.SHUT_RDWR)
        return peer
    except OSError:
        return None
    finally:
        s.close()
