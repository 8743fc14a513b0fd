"""The Ray channel, sending side: how a `transfer.session.SenderSession` reaches a decode worker's
`RayReceiverEndpoint` through its actor's one channel method, `kv(call, conn, *args)` (msgpack
bytes in and out; payload pieces as numpy arrays that Ray copies once into its object store, or
inline under 100 KiB).

A whole transfer is one call: the manifest with its frames ("receive"), or, when the receiver
mapped this side's /dev/shm pool at the handshake (same node, `ray_shm`), only the frames' byte
offsets in it ("receive_shm"): one copy, pool to pool. A streamed transfer is an "offer", one
"blocks" call per batch of pieces (headers: `ray_wire`) and a "final", with at most one call
outstanding, so a threaded actor never sees them out of order; the previous batch lands while
the feed waits for the next prefill chunk. A failed stream sends "cancel". Every wait is a
bounded `ray.get`. `RaySender(fingerprint, actor, config)` is a session over this channel.
"""

from __future__ import annotations

import dataclasses
import time
import uuid

import numpy as np

from transfer.codec import decode_reply, unpack
from transfer.errors import MalformedMessage, TransferTimeout
from transfer.messages import Nack
from transfer.ray_shm import encode_offsets, pool_offsets
from transfer.ray_wire import BLOCKS, CANCEL, FINAL, OFFER, OK, StreamHeader, decode_header, encode_header
from transfer.session import SenderSession
from transfer.transport import TransportConfig


def RaySender(fingerprint: dict, actor, config: TransportConfig | None = None, *, metrics=None, faults=None,
              pool=None):
    """A sender session over a Ray channel to `actor`. pool: this side's KVStorage (a /dev/shm pool
    is read in place by a same-node receiver). Ray sends whole frames with their checksums in the
    manifest."""
    config = dataclasses.replace(config or TransportConfig(), checksum_mode="manifest")
    return SenderSession(fingerprint, config, RayChannel(actor, config, pool), metrics=metrics, faults=faults)


def make_sender(fingerprint, config, *, receiver: str = "", namespace: str = "", faults=None, pool=None):
    """The registry's factory: a session to the decode worker actor named `receiver`."""
    import ray

    actor = ray.get_actor(receiver, namespace=namespace)
    return RaySender(fingerprint, actor, config, faults=faults, pool=pool)


class RayChannel:
    def __init__(self, actor, config: TransportConfig, pool=None):
        self.actor, self.config, self.pool = actor, config, pool
        self.conn = uuid.uuid4().hex  # this connection, as the receiver knows it
        self.shm = False  # the receiver mapped our pool at the handshake
        self.connected = False

    def get(self, ref, deadline: float, what: str) -> bytes:
        import ray

        timeout = max(0.001, deadline - time.monotonic())
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref)
            raise TransferTimeout(f"no {what} from the receiving actor within {timeout:.3g}s") from None
        except ray.exceptions.RayError as e:  # the actor died or raised
            raise TransferTimeout(f"receiving actor failed during {what}: {type(e).__name__}") from None

    # ---- transfer.channel.SenderChannel ---------------------------------------------------------------
    def hello_fields(self) -> dict:
        return {"pool_path": getattr(self.pool, "shm_path", None) or ""}

    def request(self, kind: str, body: bytes, deadline: float) -> bytes:
        return self.get(self.call(kind, body), deadline, f"{kind} reply")

    def call(self, call: str, *args):
        """One channel call to the receiving actor (an ObjectRef to its reply bytes)."""
        return self.actor.kv.remote(call, self.conn, *args)

    def accepted(self, reply) -> None:
        path = self.hello_fields()["pool_path"]
        self.shm = bool(path) and reply.data_path == path
        self.connected = True

    def open(self, token: int, manifest, bodies: list[bytes], frames=None, *, streamed: bool = False,
             deadline: float = float("inf")):
        if streamed:
            return _Stream(self, token, bodies)
        return _Whole(self, bodies, frames)

    def close(self) -> None:
        """Nothing held open (actor calls); the next migration handshakes again."""
        self.connected = False


class _Whole:
    """A whole transfer: one call once every piece is known."""

    def __init__(self, ch: RayChannel, bodies: list[bytes], frames):
        self.ch, self.bodies, self.frames = ch, bodies, frames
        self.pieces: list = []
        self.ref = None

    def send(self, items) -> bool:
        if self.frames is None:  # no host frames (a fault rewrote the pieces): rebuilt from them
            self.pieces += [(key[0], bytes(view)) for key, view in items]
        else:
            for _ in items:  # the pieces are views of `frames`: nothing to copy
                pass
        return True

    def _frames(self) -> list:
        if self.frames is not None:
            return list(self.frames)
        out: dict[int, bytearray] = {}
        for f, data in self.pieces:  # a chunk dropped, duplicated or reordered stays so in its frame
            out.setdefault(f, bytearray()).extend(data)
        return [bytes(out[f]) for f in sorted(out)]

    def end(self, final_body) -> None:
        ch = self.ch
        if not self.bodies:  # a dropped call: the sender waits out its bound, as for a lost message
            return
        offsets = pool_offsets(ch.pool, self.frames) if ch.shm else None
        if offsets is not None:  # same node: the receiver copies the frames out of our pool file
            self.ref = ch.call("receive_shm", self.bodies[0], encode_offsets(offsets))
            return
        args = [np.frombuffer(f, dtype=np.uint8) for f in self._frames()]
        for body in self.bodies:
            self.ref = ch.call("receive", body, *args)

    def verdict(self, deadline: float) -> bytes:
        if self.ref is None:
            time.sleep(max(0.0, deadline - time.monotonic()))
            raise TransferTimeout("no ack from the receiving actor: the call never went")
        return self.ch.get(self.ref, deadline, "ack")

    def cancel(self) -> None:
        pass


class _Stream:
    """A streamed transfer's calls, at most one outstanding."""

    def __init__(self, ch: RayChannel, token: int, bodies: list[bytes]):
        self.ch, self.token, self.seq = ch, token, 0
        self.pending = None
        self.limit = ch.config.transfer_timeout_s
        for body in bodies:  # a dropped offer: the receiver refuses the blocks of a stream it never saw
            self._submit("offer", StreamHeader(OFFER, token), body)

    def _wait(self) -> None:
        if self.pending is not None:
            ref, self.pending = self.pending, None
            self._answer(self.ch.get(ref, time.monotonic() + self.limit, "stream reply"))

    def _answer(self, data) -> None:
        """OK, or the nack's typed error raised."""
        limits = self.ch.config.limits
        if unpack(data, limits).get("kind") == OK:
            h = decode_header(data, limits, OK)
            if h.token != self.token:
                raise MalformedMessage(f"reply for stream {h.token}, expected {self.token}")
            return
        decode_reply(data, Nack, limits, _Uncounted())  # raises: the nack's error, or MalformedMessage

    def _submit(self, method: str, header: StreamHeader, *args) -> None:
        self._wait()
        self.pending = self.ch.call(method, encode_header(header), *args)

    def send(self, items) -> bool:
        pieces = list(items)
        if pieces:  # Ray copies each array into its object store (or inline) at submission
            keys = [k for k, _ in pieces]
            header = StreamHeader(BLOCKS, self.token, self.seq, tuple(k[0] for k in keys),
                                  tuple(k[1] for k in keys), tuple(k[3] for k in keys))
            self._submit("blocks", header, *[np.frombuffer(v, dtype=np.uint8) for _, v in pieces])
            self.seq += 1
        return True

    def end(self, final_body: bytes) -> None:
        self._wait()  # every batch landed and verified before the final goes
        header = encode_header(StreamHeader(FINAL, self.token, self.seq))
        self.pending = self.ch.call("final", header, final_body)

    def verdict(self, deadline: float) -> bytes:
        ref, self.pending = self.pending, None
        return self.ch.get(ref, deadline, "ack")

    def cancel(self) -> None:
        """Fire and forget: the receiver aborts the stream (it expires it anyway when idle)."""
        try:
            header = encode_header(StreamHeader(CANCEL, self.token))
            self.ch.call("cancel", header)
        except Exception:  # noqa: BLE001 - the actor is gone: nothing left to cancel
            pass


class _Uncounted:
    """The session counts every error a channel raises once; decode_reply must not count it too."""

    def record_error(self, err) -> None:
        pass
