"""What a ZeroMQ receiver keeps about its peers, bounded in count and in time (ARCHITECTURE.md,
convention 15). `PeerTable` holds one `Peer` per connection identity: those that completed a
handshake (at most `MAX_PEERS`, the least recently heard idle one forgotten first) apart from
strangers (at most `MAX_STRANGERS`, each forgotten `preauth_s` after it first spoke), so a flood
of unauthenticated identities can neither grow memory nor push out a real sender's state.
`IdleConnections` closes the connections themselves: it follows the ROUTER's accepted and closed
connections through a socket monitor and shuts down, below ZeroMQ, every one that has not
completed a handshake `preauth_s` after it was accepted (ZeroMQ has no call to drop one peer of a
ROUTER; a shut-down socket is closed by its I/O thread as if the peer had hung up). It also counts
the connections libzmq itself dropped in its handshake (a peer without the cluster's CURVE key:
`zmq_receiver`) as "curve" refusals.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections import OrderedDict

import zmq
from zmq.utils.monitor import parse_monitor_message

from transfer.channels.zmq_handshake import describe
from transfer.pull import drop_source

MAX_PEERS = 4096      # connections with a completed handshake whose state is kept
MAX_STRANGERS = 1024  # connections without one
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class Peer:
    """One sender connection's state; those with a transfer in progress are also in `active` (so
    the per-message walks over transfers never touch the many idle connections)."""

    def __init__(self, ident: bytes, active: dict) -> None:
        self._ident, self._active, self._session = ident, active, None
        self.plan = None  # transfer.reblock.CompatPlan once a handshake succeeded
        self.name = ""  # the sender's name from its handshake
        self.landing = None  # the session's payload landing on the bulk link (bulk_receiver)
        self.final = None  # a streamed migration's closing state (None: not yet / not one)
        self.awaits_final = False        # streamed migration: commit only after `final` and the payload
        self.landed = False              # its payload finished landing while `final` was still missing
        self.token, self.t0 = -1, 0.0
        self.source = None  # its pool, when it offered one this receiver can read (transfer.pull)
        self.pulled = None  # (offsets, digests read ahead or None) of a pulled payload whose checksums follow
        self.fd, self.since = -1, time.monotonic()  # its connection's descriptor; first heard

    @property
    def session(self):
        return self._session

    @session.setter
    def session(self, session) -> None:
        self._session = session
        if session is None:
            self._active.pop(self._ident, None)
        else:
            self._active[self._ident] = self


class PeerTable:
    def __init__(self, active: dict, preauth_s: float):
        self.active, self.preauth_s = active, preauth_s
        self.known: OrderedDict[bytes, Peer] = OrderedDict()
        self.strangers: OrderedDict[bytes, Peer] = OrderedDict()

    def get(self, ident: bytes) -> Peer:
        p = self.known.get(ident)
        if p is not None:
            self.known.move_to_end(ident)
            return p
        p = self.strangers.get(ident)
        if p is None:
            if len(self.strangers) >= MAX_STRANGERS:
                self.strangers.popitem(last=False)
            p = self.strangers[ident] = Peer(ident, self.active)
        return p

    def trust(self, ident: bytes, peer: Peer) -> None:
        """The peer completed a handshake: it joins the known peers."""
        if self.strangers.pop(ident, None) is None and ident in self.known:
            return
        if len(self.known) >= MAX_PEERS:  # forget the least recently heard idle connection
            for k, old in self.known.items():
                if old.session is None:
                    del self.known[k]
                    drop_source(old)  # its pool reader (transfer.pull) holds resources
                    break
        self.known[ident] = peer

    def sweep(self, now: float) -> None:
        """Forget strangers first heard more than preauth_s ago (oldest first)."""
        while self.strangers:
            ident, p = next(iter(self.strangers.items()))
            if now - p.since <= self.preauth_s:
                break
            del self.strangers[ident]

    def values(self) -> list[Peer]:
        return [*self.known.values(), *self.strangers.values()]


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
