"""The ZeroMQ channel, sending side: how a `transfer.session.SenderSession` reaches a `ZmqReceiver`.

A DEALER socket connected to the receiver carries the control messages (wire format:
`transfer.wire`; what is sent when: `message_channel`, shared with the Ray channel), a CURVE
client with the cluster's key when the config has a secret (`zmq_handshake`); payloads go on the
bulk link the receiver offers in its hello reply (`bulk_sender.BulkLink`, opened with the signed
token), or as ZeroMQ messages behind the manifest when the payload is at most `inline_bytes`, the
data plane is "zmq" or the receiver will not open the bulk link (full or flooded: that transfer
falls back, counted), or stay where they are when the receiver accepted this side's pool offer
(`transfer.pull`: it reads them from there).
`ZmqSender(fingerprint, config)` is a session over this channel.
"""

from __future__ import annotations

import time

import zmq

from transfer.channels.bulk_sender import FALLBACKS, OPEN_SLACK_S, BulkLink
from transfer.channels.message_channel import MessageChannel
from transfer.channels.zmq_handshake import HandshakeWatch, client_keys
from transfer.errors import TransportClosed, Unauthenticated
from transfer.session import SenderSession
from transfer.transport import TransportConfig
from transfer.wire import parse_address

# payload messages up to this size are copied into ZeroMQ's own buffer when sent (pyzmq's default:
# 64 KiB, so a 64 KiB chunk went zero-copy); `python -m bench.small_move`
COPY_BELOW = 256 << 10


def ZmqSender(fingerprint: dict, config: TransportConfig | None = None, *, metrics=None, faults=None,
              advert=None):
    """A sender session over a ZeroMQ channel to the receiver at config.address. advert: this
    side's pool, offered for the receiver to read payloads from (`transfer.pull`), or None."""
    config = config or TransportConfig()
    channel = ZmqChannel(config, metrics, advert)
    return SenderSession(fingerprint, config, channel, metrics=metrics, faults=faults)


class ZmqChannel(MessageChannel):
    """The messages on a DEALER socket; payloads on the bulk link when the receiver offers one."""

    def __init__(self, config: TransportConfig, metrics=None, advert=None):
        super().__init__(config, metrics, advert)
        self.bulk: BulkLink | None = None  # the bulk link, when the receiver offered one
        self.scheme, self.where = parse_address(self.config.address)
        self.watch: HandshakeWatch | None = None  # the socket's ZeroMQ handshake failures (`_open`)
        self.poller: zmq.Poller | None = None  # the socket and its watch
        self.ctx = self._context()
        self._open()

    def _context(self):
        return zmq.Context(io_threads=self.config.io_threads)

    def _open(self) -> None:
        s = self.sock = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 0)  # chunks are zero-copy references: queueing them costs no memory
        # ...above this size; below it a copy is cheaper than the zero-copy release, which wakes
        # pyzmq's garbage-collector thread for the GIL once per message
        s.copy_threshold = COPY_BELOW
        s.setsockopt(zmq.MAXMSGSIZE, self.config.limits.max_message_bytes)  # replies are small
        if self.config.socket_buffer_bytes:
            s.setsockopt(zmq.SNDBUF, self.config.socket_buffer_bytes)
            s.setsockopt(zmq.RCVBUF, self.config.socket_buffer_bytes)
        client_keys(s, self.config.secret)  # a keyed receiver admits only the cluster's CURVE key
        self.watch = HandshakeWatch(s)
        self.poller = zmq.Poller()
        self.poller.register(s, zmq.POLLIN)
        self.poller.register(self.watch.monitor, zmq.POLLIN)
        s.connect(self.config.address)

    def _close_socket(self) -> None:
        if self.watch is not None:
            self.watch.close()
        self.sock.close(0)

    def close(self) -> None:
        super().close()
        self.ctx.term()

    def _readable(self, timeout_ms: int) -> bool:
        """Whether a reply is queued within `timeout_ms`; Unauthenticated (and a reset) as soon as
        the socket's ZeroMQ handshake fails (`zmq_handshake`)."""
        ready = dict(self.poller.poll(timeout_ms))
        failed = self.watch.failure() if self.watch.monitor in ready else None
        if failed is not None:
            self.reset()
            raise Unauthenticated(f"{self.config.address}: {failed}")
        return self.sock in ready

    def send(self, parts: list, *, copy: bool = True, track: bool = False):
        """Send one message, waiting at most `connect_timeout_s` for the socket to take it. A
        DEALER takes messages while it has a connection (its queue is unbounded, SNDHWM 0) but
        blocks, forever, while it has none, and libzmq drops the connection for good when the
        handshake fails for a protocol reason (a receiver that wants CURVE from a sender without
        the key). So: Unauthenticated at once when the watch saw the handshake fail,
        TransportClosed when nothing took the message in time; either resets the socket."""
        deadline = time.monotonic() + self.config.connect_timeout_s
        while True:
            try:
                return self.sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=copy, track=track)
            except zmq.Again:
                pass
            failed = self.watch.failure()
            if failed is not None:
                self.reset()
                raise Unauthenticated(f"{self.config.address}: {failed}")
            left = deadline - time.monotonic()
            if left <= 0:
                self.reset()
                raise TransportClosed(f"{self.config.address}: no connection took the message within "
                                      f"{self.config.connect_timeout_s:g} s")
            self.sock.poll(max(1, min(50, int(left * 1000))), zmq.POLLOUT)

    def open_bulk(self) -> bool:
        """Open the bulk link if it is not open; when the receiver will not take it (its slots
        are full, it is flooded: issue 49) the transfer goes on the control socket instead,
        counted (`data_stream_fallbacks`) and logged at a bounded rate."""
        try:
            self.bulk.open()
            return True
        except TransportClosed as e:
            self.metrics.add("data_stream_fallbacks")
            FALLBACKS.note(f"{self.config.address}: {e}; this transfer goes on the control socket")
            return False

    # ---- transfer.channel.SenderChannel ---------------------------------------------------------------
    def hello_fields(self) -> dict:
        return {"stream": self.scheme if self.config.data_plane == "stream" else ""}

    def accepted(self, reply) -> None:
        """The receiver's hello reply: a bulk link when it offered one."""
        super().accepted(reply)
        self.close_bulk()
        self.bulk = None
        if reply.data_token and (reply.data_port or reply.data_path) and self.hello_fields()["stream"]:
            at = ("tcp", self.where, reply.data_port) if self.scheme == "tcp" else ("ipc", reply.data_path)
            self.bulk = BulkLink(at, reply.data_token, self.config.connect_timeout_s,
                                 self.config.stream_open_s + OPEN_SLACK_S)
