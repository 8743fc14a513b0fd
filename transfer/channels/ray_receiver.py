"""Ray transport, receiving side (`ray_channel` is the sending side): the protocol of
`transfer.receiver.MessageReceiver`, its messages carried by a Ray actor's calls.

A sender's call is `kv(conn, headers, *bodies)`: `headers`, a msgpack list of the messages'
headers (the wire format of `transfer.wire`), and one body per header, a payload chunk as a
numpy array that Ray maps zero-copy from its object store (or passes inline under 100 KiB). The
call's return value is every answer the protocol produced for that connection meanwhile, a
msgpack list of [header, body] pairs (`encode_replies`). Nothing of ours is pickled. A decode
worker's actor `deliver`s each call to this endpoint's inbox, served inside `poll` on its loop
thread like a socket's messages (`wake` ends a poll early); an actor that owns nothing else
(`measure.ray_receiver.PoolReceiver`) runs the calls on its own thread (`kv`). A sender on the same
node reads nothing through the object store: it offers its /dev/shm pool (`transfer.pull`) and
this side copies each transfer straight out of it.
"""

from __future__ import annotations

import concurrent.futures
import queue
import select
import time

import msgpack

from transfer.errors import MalformedMessage, TransferError, TransportClosed
from transfer.importer import ImportResult
from transfer.receiver import ListParts, MessageReceiver
from transfer.transport import TransportConfig
from transfer.wakeup import Wakeup
from transfer.wire_codec import encode
from transfer.wire_messages import Nack

MAX_MESSAGES = 4096  # messages in one call (a batch of chunks) and answers queued per connection


def encode_replies(replies: list) -> bytes:
    return msgpack.packb([[h, b] for h, b in replies], use_bin_type=True)


def decode_headers(data, limit: int = MAX_MESSAGES) -> list[bytes]:
    """A call's headers: a msgpack list of at most `limit` byte strings of at most 64 bytes."""
    try:
        headers = msgpack.unpackb(data, raw=False, max_array_len=limit, max_bin_len=64, max_str_len=0,
                                  max_map_len=0, max_ext_len=0)
    except Exception as e:  # noqa: BLE001 - msgpack raises many kinds
        raise MalformedMessage(f"call headers are not a msgpack list: {type(e).__name__}") from None
    if type(headers) is not list or any(type(h) is not bytes for h in headers):
        raise MalformedMessage("call headers must be a list of byte strings")
    return headers


class RayReceiverEndpoint(MessageReceiver):
    """Decode side. `deliver` from any thread; everything else on the owner's thread."""

    def __init__(self, manager, config: TransportConfig | None = None, **kwargs):
        """kwargs: MessageReceiver's (epochs, metrics, stage, admission)."""
        super().__init__(manager, config, **kwargs)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # (conn, headers, bodies, future)
        self._outbox: dict[bytes, list] = {}  # connection -> answers not returned yet
        self._committed: list[ImportResult] = []  # imports committed by calls, not yet polled
        self._failed: list[TransferError] = []  # their failures, raised from poll as a socket's are
        self.wakeup = Wakeup()

    @property
    def address(self) -> str:
        return f"ray://{self.config.peer_name}"  # senders find the actor by this name

    # ---- the actor's threads ----------------------------------------------------------------------
    def deliver(self, conn: str, headers: bytes, bodies: tuple) -> concurrent.futures.Future:
        """Queue one call for the owner's `poll` (any thread); its future gets the answers."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put((conn, headers, bodies, future))
        self.wakeup.set()
        return future

    def kv(self, conn: str, headers: bytes, *bodies) -> bytes:
        """The channel's entry point for an actor that runs the calls on its own thread."""
        return self.handle(conn, headers, bodies)

    # ---- the owner's thread -----------------------------------------------------------------------
    def handle(self, conn: str, headers: bytes, bodies: tuple) -> bytes:
        """Serve one call's messages in order; the answers for this connection. Never raises."""
        ident = b"ray:" + str(conn)[:128].encode("utf-8", "replace")
        try:
            hs = decode_headers(headers)
            if len(hs) != len(bodies):
                raise MalformedMessage(f"{len(hs)} headers for {len(bodies)} bodies")
        except MalformedMessage as e:
            self.metrics.record_error(e)
            return encode_replies([(b"N", encode(Nack("", 0, e.code, str(e))))])
        for header, body in zip(hs, bodies):
            try:
                result = self._dispatch(ident, self.peers.get(ident), ListParts([header, body]))
            except TransferError as e:  # nacked and counted already
                self._failed.append(e)
                continue
            if result is not None:
                self._committed.append(result)
        return encode_replies(self._outbox.pop(ident, []))

    def _deliver(self, ident: bytes, header: bytes, body: bytes) -> None:
        out = self._outbox.setdefault(ident, [])
        out.append((header, body))
        if len(out) > MAX_MESSAGES:  # answers nobody collects (a sender gone) stay bounded
            out.pop(0)
            self.metrics.add("replies_dropped")

    # ---- transfer.channel.ReceiverEndpoint ---------------------------------------------------------
    def wake(self) -> None:
        self.wakeup.set()

    def poll(self, timeout: float) -> ImportResult | None:
        """Serve the delivered calls until one commits an import (returned) or fails (its error
        raised), `timeout` passes or `wake()` is called (None). Transfers silent past their bounds
        (their prefill died) are aborted meanwhile."""
        deadline = time.monotonic() + timeout
        while True:
            while True:
                try:
                    conn, headers, bodies, future = self._inbox.get_nowait()
                except queue.Empty:
                    break
                future.set_result(self.handle(conn, headers, bodies))
            self._expire()  # raises the first expired transfer's error, as a socket's poll does
            now = time.monotonic()
            self.peers.sweep(now)
            if self._committed:
                return self._committed.pop(0)
            if self._failed:
                raise self._failed.pop(0)
            if now >= deadline or not select.select([self.wakeup.fd], [], [], deadline - now)[0]:
                return None
            self.wakeup.clear()
            if self._inbox.empty():
                return None  # woken for the owner (a queued command)

    def close(self) -> None:
        """Every transfer ends (blocks returned), queued calls are refused, committed imports never
        handed to the owner are returned."""
        self._forget_all()
        closed = encode(Nack("", 0, TransportClosed.code, "the receiver closed"))
        while not self._inbox.empty():
            self._inbox.get_nowait()[3].set_result(encode_replies([(b"N", closed)]))
        for result in self._committed:
            self.manager.free(result.seq_id, uncache=True)
        self._committed.clear()
        self.wakeup.close()
