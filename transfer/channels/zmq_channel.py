"""The ZeroMQ channel, sending side: how a `transfer.session.SenderSession` reaches a `ZmqReceiver`.

A DEALER socket connected to the receiver carries the control messages (wire format:
`transfer.wire`), a CURVE client with the cluster's key when the config has a secret
(`zmq_handshake`); payloads go on the bulk link the receiver offers in its hello reply
(`bulk_sender.BulkLink`, opened with the signed token), or as ZeroMQ messages behind the
manifest when the payload is at most `inline_bytes`, the data plane is "zmq" or the receiver will
not open the bulk link (full or flooded: that transfer falls back, counted), or stay where
they are when the receiver accepted this side's pool offer (`transfer.pull`: it reads them from
there). Chunks are sent zero-copy from pool memory or a staging slot; between chunks the channel
checks whether the receiver already answered (it gave up early), and stops. Every wait is a
bounded poll; a timeout resets the connection (the receiver may or may not have committed: the
session keeps the lease).
`ZmqSender(fingerprint, config)` is a session over this channel.
"""

from __future__ import annotations

import contextlib
import time

import zmq

from transfer.channels.bulk_sender import FALLBACKS, OPEN_SLACK_S, BulkLink
from transfer.channels.bulk_wire import parse_address
from transfer.channels.zmq_handshake import HandshakeWatch, client_keys
from transfer.errors import TransferError, TransferTimeout, TransportClosed, Unauthenticated
from transfer.pull import encode_offsets, shm_advert
from transfer.session import SenderSession
from transfer.transport import TransportConfig
from transfer.wire import DATA, TOKEN
from transfer.wire_codec import decode, encode
from transfer.wire_messages import Nack, PoolReply

# payload messages up to this size are copied into ZeroMQ's own buffer when sent (pyzmq's default:
# 64 KiB, so a 64 KiB chunk went zero-copy); `python -m bench.small_move`
COPY_BELOW = 256 << 10

# a control request -> (its header, its reply's header)
_REQUESTS = {"hello": (b"H", b"h"), "query": (b"Q", b"q"), "pool": (b"U", b"u")}


def ZmqSender(fingerprint: dict, config: TransportConfig | None = None, *, metrics=None, faults=None,
              advert=None):
    """A sender session over a ZeroMQ channel to the receiver at config.address. advert: this
    side's pool, offered for the receiver to read payloads from (`transfer.pull`), or None."""
    config = config or TransportConfig()
    channel = ZmqChannel(config, metrics, advert)
    return SenderSession(fingerprint, config, channel, metrics=metrics, faults=faults)


def make_sender(fingerprint, config, *, receiver: str = "", namespace: str = "", faults=None, pool=None):
    """The registry's factory; a sending worker whose pool lives in /dev/shm offers it to a
    same-node receiver (`transfer.pull`), which then reads payloads from it instead of the socket."""
    return ZmqSender(fingerprint, config, faults=faults, advert=shm_advert(pool))


class ZmqChannel:
    def __init__(self, config: TransportConfig, metrics=None, advert=None):
        from transfer.metrics import DEFAULT_METRICS

        self.config, self.metrics = config, metrics or DEFAULT_METRICS
        self.advert, self.pull = advert, False  # pull: the receiver reads our pool (it accepted the offer)
        self.offered = advert is None  # the pool was offered since the last handshake
        self.sock = None  # what carries the messages: a DEALER socket here (`_open`)
        self.bulk: BulkLink | None = None  # the bulk link, when the receiver offered one
        self.scheme, self.where = self._where()
        self.connected = False  # a handshake answered on this socket (a reset forgets it)
        self.watch: HandshakeWatch | None = None  # the socket's ZeroMQ handshake failures (`_open`)
        self.poller: zmq.Poller | None = None  # the socket and its watch
        self.ctx = self._context()
        self._open()

    def _context(self):
        return zmq.Context(io_threads=self.config.io_threads)

    def _where(self) -> tuple[str, str]:
        return parse_address(self.config.address)

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

    def reset(self) -> None:
        """A fresh socket (the receiver forgets this connection's handshake) and no bulk link."""
        self.connected = False
        self._close_socket()
        self.close_bulk()
        self._open()

    def close_bulk(self) -> None:
        """Close the bulk link's socket; the next transfer opens a fresh one (same token)."""
        if self.bulk is not None:
            self.bulk.close()

    def close(self) -> None:
        self.close_bulk()
        self._close_socket()
        if self.ctx is not None:
            self.ctx.term()
        if self.advert is not None:
            self.advert.close()

    def flush(self) -> None:
        """Messages go as they are sent on a socket (a channel that batches them sends them now)."""

    # ---- waiting ------------------------------------------------------------------------------------
    def reply(self, headers: tuple[bytes, ...]):
        """One queued reply if it is one of `headers` (or a garbled-message nack), else None."""
        parts = self.sock.recv_multipart()
        if len(parts) == 2 and (parts[0] in headers or parts[0] == b"N"):
            return parts
        self.metrics.add("stray_replies")
        return None

    def _readable(self, timeout_ms: int) -> bool:
        """Whether a reply is queued within `timeout_ms`; Unauthenticated (and a reset) as soon as
        the socket's ZeroMQ handshake fails (`zmq_handshake`)."""
        if self.poller is None:
            return bool(self.sock.poll(timeout_ms))
        ready = dict(self.poller.poll(timeout_ms))
        failed = self.watch.failure() if self.watch.monitor in ready else None
        if failed is not None:
            self.reset()
            raise Unauthenticated(f"{self.config.address}: {failed}")
        return self.sock in ready

    def wait(self, headers: tuple[bytes, ...], deadline: float, what: str) -> bytes:
        """The body of the next reply under one of `headers`; TransferTimeout (and a reset) at deadline."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.reset()
                raise TransferTimeout(f"no {what} from {self.config.address} within the timeout")
            if not self._readable(max(1, int(left * 1000))):
                continue
            got = self.reply(headers)
            if got is not None:
                return got[1]

    # ---- transfer.channel.SenderChannel ---------------------------------------------------------------
    def hello_fields(self) -> dict:
        return {"stream": self.scheme if self.config.data_plane == "stream" else ""}

    def request(self, kind: str, body: bytes, deadline: float) -> bytes:
        header, answer = _REQUESTS[kind]
        self.sock.send_multipart([header, body])
        return self.wait((answer,), deadline, f"{kind} reply")

    def accepted(self, reply) -> None:
        """The receiver's hello reply: a bulk link when it offered one."""
        self.connected = True
        self.close_bulk()
        self.bulk = None
        if reply.data_token and (reply.data_port or reply.data_path) and self.hello_fields()["stream"]:
            at = ("tcp", self.where, reply.data_port) if self.scheme == "tcp" else ("ipc", reply.data_path)
            self.bulk = BulkLink(at, reply.data_token, self.config.connect_timeout_s,
                                 self.config.stream_open_s + OPEN_SLACK_S)
        self.pull = False
        self.offered = self.advert is None  # the pool is offered at the first whole transfer

    def offer_pool(self) -> None:
        """Offer our pool (once per handshake, at the first whole transfer, so a way that is slow
        to set up, e.g. a NIXL agent, costs the handshake nothing); declined: bytes are pushed."""
        self.offered = True
        body = encode(self.advert.offer())  # this side's setup first (a NIXL agent: seconds under load)
        deadline = time.monotonic() + self.config.connect_timeout_s  # then the wait on the receiver
        answer = decode(self.request("pool", body, deadline), self.config.limits, (PoolReply, Nack))
        self.pull = isinstance(answer, PoolReply) and answer.accepted

    def pulls(self) -> bool:
        """Whether the receiver reads whole payloads from our pool (offered now if not yet)."""
        if not self.offered:
            self.offer_pool()
        return self.pull

    def open(self, token: int, manifest, bodies: list[bytes], frames=None, *, streamed: bool = False,
             deadline: float = float("inf")) -> _Transfer:
        big = manifest.payload_bytes > self.config.inline_bytes  # a small one follows its manifest
        if not streamed and frames is not None and big and self.pulls():
            offsets = self.advert.offsets(frames)
            if offsets is not None:  # every frame is pool memory: the receiver reads it there
                return _Pulled(self, token, bodies, offsets, manifest.checksum_mode == "inline")
        return _Transfer(self, token, manifest, bodies, streamed, deadline)


class _Pulled:
    """A whole transfer the receiver reads from our pool: "M", then "P" with each frame's offset;
    with "inline" checksums, "K" with them follows, hashed here while the receiver reads."""

    def __init__(self, ch: ZmqChannel, token: int, bodies: list[bytes], offsets: list[int], sums: bool):
        self.ch, self.token, self.sums = ch, token, sums
        for body in bodies:
            ch.sock.send_multipart([TOKEN.pack(b"M", token), body])
        ch.sock.send_multipart([TOKEN.pack(b"P", token), encode_offsets(offsets)])
        ch.flush()  # the read starts now

    def send(self, items) -> bool:
        """The pieces stay where they are; with "inline" checksums, theirs go (hashed now)."""
        if self.sums:
            sums = [cs for (_, _, _, cs), _ in items]
            self.ch.sock.send_multipart([TOKEN.pack(b"K", self.token), encode_offsets(sums)])
            self.ch.flush()
        return True

    def end(self, final_body) -> None:
        pass

    def verdict(self, deadline: float) -> bytes:
        return self.ch.wait((TOKEN.pack(b"A", self.token),), deadline, "ack")

    def cancel(self) -> None:
        pass


class _Transfer:
    """One transfer. Whole: "M" with "D" chunks and an "E" on the control socket, or "S" with the
    payload on the bulk link (above `inline_bytes`). Streamed (its final state follows): "O", the
    chunks on the bulk link as they come, the link's end, then "F" with the state; without a
    bulk link, "W", then each batch's "D" chunks, then "F"."""

    def __init__(self, ch: ZmqChannel, token: int, manifest, bodies: list[bytes], streamed: bool,
                 deadline: float):
        self.ch, self.token, self.deadline, self.early = ch, token, deadline, None
        self.sock = ch.sock  # the connection it runs on (a timeout's reset replaces the channel's)
        self.ack_header = TOKEN.pack(b"A", token)
        self.streamed = streamed
        big = manifest.payload_bytes > ch.config.inline_bytes
        self.on_bulk = ch.bulk is not None and (streamed or big) and self._bulk_opens()
        kind = (b"O" if self.on_bulk else b"W") if streamed else b"S" if self.on_bulk else b"M"
        try:
            for body in bodies:
                ch.sock.send_multipart([TOKEN.pack(kind, token), body])
        except TransferError:
            ch.reset()
            raise
        self.live = ch.bulk.begin(token, manifest.payload_bytes) if self.on_bulk else True

    def _bulk_opens(self) -> bool:
        """Open the bulk link if it is not open; when the receiver will not take it (its slots
        are full, it is flooded: issue 49) the transfer goes on the control socket instead,
        counted (`data_stream_fallbacks`) and logged at a bounded rate."""
        try:
            self.ch.bulk.open()
            return True
        except TransportClosed as e:
            self.ch.metrics.add("data_stream_fallbacks")
            FALLBACKS.note(f"{self.ch.config.address}: {e}; this transfer goes on the control socket")
            return False

    def answered(self) -> bool:
        """An early verdict (the receiver gave up) is waiting, or the deadline passed: stop sending."""
        if self.early is None and self.ch.sock.poll(0):
            self.early = self.ch.reply((self.ack_header,))
        return self.early is not None or time.monotonic() > self.deadline

    def send(self, items) -> bool:
        """Payload pieces ((frame, chunk, slot, xxh3), view); False once the transfer stopped."""
        if self.live:
            self.live = (self.ch.bulk.send_chunks(items, self.answered) if self.on_bulk
                         else self._send_control(items))
            if self.streamed:
                self.ch.flush()  # this batch goes now, while the prompt's next chunk computes
        return self.live

    def _send_control(self, items) -> bool:
        sock = self.ch.sock
        for (f, c, slot, cs), view in items:
            tracker = sock.send_multipart([DATA.pack(b"D", self.token, f, c, cs), view], copy=False,
                                          track=slot is not None)
            if slot is not None:
                slot.tracker = tracker
            if self.answered():
                return False
        return True

    def end(self, final_body: bytes | None) -> None:
        ch = self.ch
        if not self.on_bulk:
            kind = b"F" if self.streamed else b"E"
            ch.sock.send_multipart([TOKEN.pack(kind, self.token), final_body or b""])
        elif ch.bulk.end() and final_body is not None:
            ch.sock.send_multipart([TOKEN.pack(b"F", self.token), final_body])

    def verdict(self, deadline: float) -> bytes:
        if self.early is not None:
            return self.early[1]
        return self.ch.wait((self.ack_header,), deadline, "ack")

    def cancel(self) -> None:
        """The transfer failed on this side: the receiver aborts it (closing the bulk link does
        that for a streamed import; the next transfer opens a fresh link). Never raises."""
        if self.on_bulk:
            self.ch.close_bulk()
        elif self.streamed and self.ch.sock is self.sock:  # after a reset the receiver forgot it anyway
            with contextlib.suppress(Exception):
                self.ch.sock.send_multipart([TOKEN.pack(b"C", self.token), b""])
                self.ch.flush()
