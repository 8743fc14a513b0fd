"""The sending end of the bulk link (`bulk_wire`): one socket from a prefill worker's
`ZmqSender` to a receiver's bulk listener, opened with the token from the signed handshake
and confirmed by the receiver. `send` writes one transfer (header, then the payload chunks
straight from pool memory or a staging slot, coalesced into `sendmsg` calls), checking between
chunks whether the receiver already answered on the control channel; a streamed migration uses
`begin`, `send_chunks` (as blocks complete) and `end` instead. Any socket error closes
the link; the next transfer opens a fresh one with the same token. A link the receiver will
not open (full, flooded) sends that transfer over the control socket instead (`zmq_channel`),
and `FALLBACKS` says so at a bounded rate.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time

from transfer.channels.bulk_open import BUSY, OPENED
from transfer.channels.bulk_wire import CHUNK, END, OPEN, OPEN_MAGIC, XFER, XFER_MAGIC, recv_exact, send_views
from transfer.errors import TransportClosed

log = logging.getLogger("transfer.bulk")


# how long an opening may wait beyond the receiver's own deadline for it (`stream_open_s`, counted
# from its accept): the time it may spend queued for that accept
OPEN_SLACK_S = 2.0


class BulkLink:
    """Where the receiver's bulk link listens (("tcp", host, port) or ("ipc", path)) and its token.
    timeout_s bounds each write; open_s the whole opening (connect, opening message, answer)."""

    def __init__(self, where: tuple, token_hex: str, timeout_s: float, open_s: float):
        self.where, self.token, self.timeout_s = where, bytes.fromhex(token_hex), timeout_s
        self.open_s = min(timeout_s, open_s)
        self.sock: socket.socket | None = None

    def open(self) -> None:
        """Open the link; TransportClosed (naming why) when the receiver does not confirm it."""
        if self.sock is not None:
            return
        s = None
        try:
            if self.where[0] == "tcp":
                s = socket.create_connection(self.where[1:], timeout=self.open_s)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            else:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(self.open_s)
                s.connect(self.where[1])
            s.sendall(OPEN.pack(OPEN_MAGIC, self.token))
            answer = recv_exact(s, 1)
            s.settimeout(self.timeout_s)
            if answer != OPENED:
                s.close()
                raise TransportClosed(
                    "the receiver's bulk link is at its connection limit" if answer == BUSY else
                    "the receiver closed the bulk link before confirming it (a token it no longer "
                    "knows, or no opening within its deadline)")
        except OSError as e:
            if s is not None:  # a refused or timed-out opening closes its socket
                s.close()
            raise TransportClosed(f"cannot open the bulk link: {type(e).__name__}: {e}") from None
        self.sock = s

    def begin(self, token: int, nbytes: int) -> bool:
        """The transfer's header (a streamed migration then sends its chunks over time)."""
        self.open()
        return self._io(lambda s: s.sendall(XFER.pack(XFER_MAGIC, token, nbytes)))

    def send_chunks(self, items, answered) -> bool:
        """Some of the transfer's chunks; False when it stopped (answered, or the link broke)."""
        for key, view in items:
            head = CHUNK.pack(key[0], key[1], key[3])
            if not self._io(lambda s, head=head, view=view: send_views(s, (head, view))):
                return False
            if answered():
                return False
        return True

    def end(self) -> bool:
        return self._io(lambda s: s.sendall(CHUNK.pack(END, 0, 0)))

    def _io(self, write) -> bool:
        if self.sock is None:
            return False
        try:
            write(self.sock)
            return True
        except OSError:
            self.close()  # the receiver's verdict (a nack) follows on the control channel
            return False

    def close(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
            self.sock = None


class FallbackLog:
    """Warnings for transfers that could not use the bulk link: at most one per `interval_s`,
    saying how many more there were since the last one (a flood makes many)."""

    def __init__(self, interval_s: float = 10.0):
        self.interval_s, self.last, self.unsaid = interval_s, -1e18, 0
        self.lock = threading.Lock()

    def note(self, what: str) -> None:
        now = time.monotonic()
        with self.lock:
            if now - self.last < self.interval_s:
                self.unsaid += 1
                return
            self.last, more, self.unsaid = now, self.unsaid, 0
        log.warning("%s%s", what[:300], f" (+{more} more since the last line)" if more else "")


FALLBACKS = FallbackLog()
