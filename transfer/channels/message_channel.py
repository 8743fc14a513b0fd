"""What the ZeroMQ and Ray channels share (`transfer.channel.SenderChannel`): the wire's messages
(`transfer.wire`) sent over a DEALER-like pipe, `sock` (`send_multipart`, `poll`,
`recv_multipart`, `close`), which each channel opens its own way: a ZeroMQ DEALER socket
(`zmq_channel.ZmqChannel`), or a `ray_channel.RayPipe` batching the messages into actor calls.

The requests and their bounded waits, the pool offer (`transfer.pull`: once per handshake, at the
first whole transfer) and the transfers: a whole one the receiver reads from this side's pool
(`_Pulled`), or one whose payload goes as messages behind its manifest, or on a side link the
channel opened (`bulk`: ZeroMQ's bulk link, `bulk_sender.BulkLink`; None on the others). Chunks
are sent zero-copy from pool memory or a staging slot; between chunks the channel checks whether
the receiver already answered (it gave up early), and stops. Every wait is a bounded poll; a
timeout resets the connection (the receiver may or may not have committed: the session keeps the
lease).
"""

from __future__ import annotations

import contextlib
import time

from transfer.errors import TransferError, TransferTimeout
from transfer.pull import encode_offsets
from transfer.transport import TransportConfig
from transfer.wire import DATA, TOKEN
from transfer.wire_codec import decode, encode
from transfer.wire_messages import Nack, PoolReply

# a control request -> (its header, its reply's header)
_REQUESTS = {"hello": (b"H", b"h"), "query": (b"Q", b"q"), "pool": (b"U", b"u")}


class MessageChannel:
    """A sender channel over a message pipe; a subclass opens the pipe (`_open`) and says which
    `Hello` fields it asks for (`hello_fields`)."""

    def __init__(self, config: TransportConfig, metrics=None, advert=None, clock=time.monotonic):
        from transfer.metrics import DEFAULT_METRICS

        self.config, self.metrics = config, metrics or DEFAULT_METRICS
        self.clock = clock  # the time deadlines are taken from (a virtual one in the simulation)
        self.advert, self.pull = advert, False  # pull: the receiver reads our pool (it accepted the offer)
        self.offered = advert is None  # the pool was offered since the last handshake
        self.sock = None  # what carries the messages (`_open`)
        # a side link for payloads, when the channel opened one (ZeroMQ's bulk link): open, begin,
        # send_chunks, end, close (`bulk_sender.BulkLink`); `open_bulk` opens it for a transfer
        self.bulk = None
        self.connected = False  # a handshake answered on this pipe (a reset forgets it)

    def _open(self) -> None:
        """Open `sock`, the pipe the messages go on."""
        raise NotImplementedError

    def _close_socket(self) -> None:
        self.sock.close(0)

    def reset(self) -> None:
        """A fresh pipe (the receiver forgets this connection's handshake) and no side link."""
        self.connected = False
        self._close_socket()
        self.close_bulk()
        self._open()

    def close_bulk(self) -> None:
        """Close the side link; the next transfer opens a fresh one."""
        if self.bulk is not None:
            self.bulk.close()

    def open_bulk(self) -> bool:
        """Whether the side link (`bulk`, not None) is open for a transfer, opened now if need be."""
        return False

    def close(self) -> None:
        self.close_bulk()
        self._close_socket()
        if self.advert is not None:
            self.advert.close()

    def flush(self) -> None:
        """Messages go as they are sent on a socket (a channel that batches them sends them now)."""

    def send(self, parts: list, *, copy: bool = True, track: bool = False):
        """Send one message (its frames) on the pipe; a tracker when `track`. A channel whose
        pipe can refuse to take a message bounds the wait (`ZmqChannel.send`)."""
        return self.sock.send_multipart(parts, copy=copy, track=track)

    # ---- waiting ------------------------------------------------------------------------------------
    def reply(self, headers: tuple[bytes, ...]):
        """One queued reply if it is one of `headers` (or a garbled-message nack), else None."""
        parts = self.sock.recv_multipart()
        if len(parts) == 2 and (parts[0] in headers or parts[0] == b"N"):
            return parts
        self.metrics.add("stray_replies")
        return None

    def _readable(self, timeout_ms: int) -> bool:
        """Whether a reply is queued within `timeout_ms`."""
        return bool(self.sock.poll(timeout_ms))

    def wait(self, headers: tuple[bytes, ...], deadline: float, what: str, then=None):
        """The body of the next reply under one of `headers` (made into the result by `then`, when
        given); TransferTimeout (and a reset) at deadline. The one blocking wait of the channel:
        the simulation (`dst.channel.SimChannel`) returns the wait itself here, and its driver
        parks the session's steps on it."""
        while True:
            left = deadline - self.clock()
            if left <= 0:
                self.reset()
                raise TransferTimeout(f"no {what} from {self.config.address} within the timeout")
            if not self._readable(max(1, int(left * 1000))):
                continue
            got = self.reply(headers)
            if got is not None:
                return then(got[1]) if then is not None else got[1]

    # ---- transfer.channel.SenderChannel ---------------------------------------------------------------
    def hello_fields(self) -> dict:
        return {"stream": ""}

    def request(self, kind: str, body: bytes, deadline: float, then=None):
        header, answer = _REQUESTS[kind]
        self.send([header, body])
        return self.wait((answer,), deadline, f"{kind} reply", then)

    def accepted(self, reply) -> None:
        """The receiver's hello reply: the pool is offered again at the next whole transfer."""
        self.connected = True
        self.pull = False
        self.offered = self.advert is None  # the pool is offered at the first whole transfer

    def offer_pool(self) -> bool:
        """Offer our pool (once per handshake, at the first whole transfer, so a way that is slow
        to set up, e.g. a NIXL agent, costs the handshake nothing); declined: bytes are pushed."""
        self.offered = True
        body = encode(self.advert.offer())  # this side's setup first (a NIXL agent: seconds under load)
        deadline = self.clock() + self.config.connect_timeout_s  # then the wait on the receiver
        return self.request("pool", body, deadline, then=self._pool_answer)

    def _pool_answer(self, body: bytes) -> bool:
        answer = decode(body, self.config.limits, (PoolReply, Nack))
        self.pull = isinstance(answer, PoolReply) and answer.accepted
        return self.pull

    def pulls(self) -> bool:
        """Whether the receiver reads whole payloads from our pool (offered now if not yet)."""
        return self.offer_pool() if not self.offered else self.pull

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

    def __init__(self, ch: MessageChannel, token: int, bodies: list[bytes], offsets: list[int], sums: bool):
        self.ch, self.token, self.sums = ch, token, sums
        for body in bodies:
            ch.send([TOKEN.pack(b"M", token), body])
        ch.send([TOKEN.pack(b"P", token), encode_offsets(offsets)])
        ch.flush()  # the read starts now

    def send(self, items) -> bool:
        """The pieces stay where they are; with "inline" checksums, theirs go (hashed now)."""
        if self.sums:
            sums = [cs for (_, _, _, cs), _ in items]
            self.ch.send([TOKEN.pack(b"K", self.token), encode_offsets(sums)])
            self.ch.flush()
        return True

    def end(self, final_body) -> None:
        pass

    def verdict(self, deadline: float) -> bytes:
        return self.ch.wait((TOKEN.pack(b"A", self.token),), deadline, "ack")

    def cancel(self) -> None:
        pass


class _Transfer:
    """One transfer. Whole: "M" with "D" chunks and an "E" on the pipe, or "S" with the payload
    on the side link (above `inline_bytes`). Streamed (its final state follows): "O", the chunks
    on the side link as they come, the link's end, then "F" with the state; without a side link,
    "W", then each batch's "D" chunks, then "F"."""

    def __init__(self, ch: MessageChannel, token: int, manifest, bodies: list[bytes], streamed: bool,
                 deadline: float):
        self.ch, self.token, self.deadline, self.early = ch, token, deadline, None
        self.sock = ch.sock  # the connection it runs on (a timeout's reset replaces the channel's)
        self.ack_header = TOKEN.pack(b"A", token)
        self.streamed = streamed
        big = manifest.payload_bytes > ch.config.inline_bytes
        self.on_bulk = ch.bulk is not None and (streamed or big) and ch.open_bulk()
        kind = (b"O" if self.on_bulk else b"W") if streamed else b"S" if self.on_bulk else b"M"
        try:
            for body in bodies:
                ch.send([TOKEN.pack(kind, token), body])
        except TransferError:
            ch.reset()
            raise
        self.live = ch.bulk.begin(token, manifest.payload_bytes) if self.on_bulk else True

    def answered(self) -> bool:
        """An early verdict (the receiver gave up) is waiting, or the deadline passed: stop sending."""
        if self.early is None and self.ch.sock.poll(0):
            self.early = self.ch.reply((self.ack_header,))
        return self.early is not None or self.ch.clock() > self.deadline

    def send(self, items) -> bool:
        """Payload pieces ((frame, chunk, slot, xxh3), view); False once the transfer stopped."""
        if self.live:
            self.live = (self.ch.bulk.send_chunks(items, self.answered) if self.on_bulk
                         else self._send_control(items))
            if self.streamed:
                self.ch.flush()  # this batch goes now, while the prompt's next chunk computes
        return self.live

    def _send_control(self, items) -> bool:
        for (f, c, slot, cs), view in items:
            tracker = self.ch.send([DATA.pack(b"D", self.token, f, c, cs), view], copy=False,
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
            ch.send([TOKEN.pack(kind, self.token), final_body or b""])
        elif ch.bulk.end() and final_body is not None:
            ch.send([TOKEN.pack(b"F", self.token), final_body])

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
                self.ch.send([TOKEN.pack(b"C", self.token), b""])
                self.ch.flush()
