"""The sending end of the raw data stream (`stream_wire`): one socket from a prefill worker's
`ZmqSender` to a receiver's stream listener, opened with the token from the signed handshake
and confirmed by the receiver. `send` writes one transfer (header, then the payload chunks
straight from pool memory or a staging slot, coalesced into `sendmsg` calls), checking between
chunks whether the receiver already answered on the control channel; a streamed migration uses
`begin`, `send_chunks` (as blocks complete) and `end` instead. Any socket error closes
the stream; the next transfer opens a fresh one with the same token.
"""

from __future__ import annotations

import contextlib
import socket

from transfer.errors import TransportClosed
from transfer.stream_open import BUSY, OPENED
from transfer.stream_wire import CHUNK, END, OPEN, OPEN_MAGIC, XFER, XFER_MAGIC, recv_exact, send_views


class DataStream:
    """Where the receiver's stream listens (("tcp", host, port) or ("ipc", path)) and its token."""

    def __init__(self, where: tuple, token_hex: str, timeout_s: float):
        self.where, self.token, self.timeout_s = where, bytes.fromhex(token_hex), timeout_s
        self.sock: socket.socket | None = None

    def open(self) -> None:
        if self.sock is not None:
            return
        try:
            if self.where[0] == "tcp":
                s = socket.create_connection(self.where[1:], timeout=self.timeout_s)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            else:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(self.timeout_s)
                s.connect(self.where[1])
            s.sendall(OPEN.pack(OPEN_MAGIC, self.token))
            answer = recv_exact(s, 1)
            if answer != OPENED:
                s.close()
                raise TransportClosed(
                    "the receiver's data stream is at its connection limit" if answer == BUSY else
                    "the receiver closed the data stream before confirming it (a token it no longer "
                    "knows, or no opening within its deadline)")
        except OSError as e:
            raise TransportClosed(f"cannot open the data stream: {type(e).__name__}: {e}") from None
        self.sock = s

    def begin(self, token: int, nbytes: int) -> bool:
        """The transfer's header (a streamed migration then sends its chunks over time)."""
        self.open()
        return self._io(lambda s: s.sendall(XFER.pack(XFER_MAGIC, token, nbytes)))

    def send_chunks(self, items, answered) -> bool:
        """Some of the transfer's chunks; False when it stopped (answered, or the stream broke)."""
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
