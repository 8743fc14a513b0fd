"""A prefill worker's senders: one open connection per decode worker, over a transport of
`transfer.registry` (its `make_sender`).

`get(name, address)` returns the sender for a decode worker, creating it (and its handshake on
first use); `connect` performs the handshake now and returns an error message instead of
raising; `forget_if_broken` drops a sender after a failure that may have broken its connection
(a timeout, a lost handshake, anything not a typed nack), so the next migration reconnects.
Use from one thread (the owner's loop).
"""

from __future__ import annotations

from transfer.errors import HandshakeRequired, TransferError, TransferTimeout
from transfer.faults import Faults
from transfer.registry import get as get_transport
from transfer.session import SenderSession
from transfer.transport import TransportConfig


class SenderSessions:
    def __init__(self, peer_name: str, transport: str, fingerprint: dict, options=None,
                 transfer_timeout_s: float = 30.0, secret: str = "", pool=None):
        """options: the transport's own (`transfer.registry`: its options dataclass, or a mapping of
        its fields as a worker's config carries them; None: its defaults)."""
        self.kind = get_transport(transport)  # ValueError for an unregistered name
        self.peer_name, self.transport, self.fingerprint = peer_name, transport, dict(fingerprint)
        self.options = self.kind.options_of(options)  # ValueError for a field it does not take
        self.transfer_timeout_s, self.secret = transfer_timeout_s, secret
        self.pool = pool  # the worker's KVStorage (Ray: a /dev/shm pool is read in place on one node)
        self._senders: dict[str, SenderSession] = {}
        self.faults = Faults()  # armed by the chaos benchmark (InjectFault); idle otherwise

    def get(self, name: str, address: str) -> SenderSession:
        sender = self._senders.get(name)
        if sender is None:
            config = TransportConfig(address=address, peer_name=self.peer_name, receiver=name,
                                     transfer_timeout_s=self.transfer_timeout_s,
                                     connect_timeout_s=min(10.0, self.transfer_timeout_s),
                                     checksum_mode=self.kind.checksum_mode, secret=self.secret)
            sender = self.kind.make_sender(self.fingerprint, config, self.options, receiver=name,
                                           faults=self.faults, pool=self.pool)
            self._senders[name] = sender
        return sender

    def connect(self, name: str, address: str) -> str | None:
        """Handshake with a decode worker now; an error message, or None when compatible."""
        try:
            self.get(name, address).connect()
        except TransferError as e:
            self.drop(name)
            return f"{type(e).__name__}: {e}"
        return None

    def forget_if_broken(self, name: str, error: Exception) -> None:
        if not isinstance(error, TransferError) or isinstance(error, (TransferTimeout, HandshakeRequired)):
            self.drop(name)

    def drop(self, name: str) -> None:
        sender = self._senders.pop(name, None)
        if sender is not None:
            sender.close()

    def close(self) -> None:
        for name in list(self._senders):
            self.drop(name)
