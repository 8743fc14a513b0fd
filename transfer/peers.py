"""What a receiver keeps about its peers, bounded in count and in time (ARCHITECTURE.md,
convention 15), whatever carries their messages. `PeerTable` holds one `Peer` per connection
identity: those that completed a handshake (at most `MAX_PEERS`, the least recently heard idle one
forgotten first) apart from strangers (at most `MAX_STRANGERS`, each forgotten `preauth_s` after it
first spoke), so a flood of unauthenticated identities can neither grow memory nor push out a real
sender's state. (A ZeroMQ receiver also closes the connections themselves: `channels.zmq_peers`.)
"""

from __future__ import annotations

import time
from collections import OrderedDict

from transfer.pull import drop_source

MAX_PEERS = 4096      # connections with a completed handshake whose state is kept
MAX_STRANGERS = 1024  # connections without one


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
