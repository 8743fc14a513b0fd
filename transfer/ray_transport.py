"""Ray transport, receiving side (`ray_channel` is the sending side): control through actor calls;
payload frames read straight from the sender's pool on one node, through Ray's object store
across nodes.

Same node (`ray_shm`): a sender whose pool lives in /dev/shm names the file in its handshake; a
receiver that can map it answers with the same path, and each transfer then passes only the
frames' byte offsets (`kv_receive_shm`), which the receiver copies from once into its blocks.
Otherwise (another node, a device pool, a re-blocked copy, a chaos fault): sender side
(`ray_channel`): each frame, a numpy view over pool memory (or over a staging buffer for device
pools), is an argument of one actor call beside the msgpack manifest; Ray copies it once into
the object store (frames under 100 KiB travel inline with the call). Receiver side
(`RayReceiverEndpoint`, a plain object living inside the decode worker's actor): Ray hands the
frames over as read-only numpy arrays mapped from shared memory (zero-copy), which
`import_sequence` copies once into the reserved blocks. Our own messages cross as msgpack bytes;
Ray serializes the call itself. The receiving actor exposes `kv_hello(conn, bytes)`,
`kv_query(conn, bytes)`, `kv_receive(conn, manifest, *frames)` and `kv_receive_shm(conn,
manifest, offsets)`, each returning msgpack bytes, and for streamed migrations
(`ray_stream_receiver`) `kv_offer`, `kv_blocks`, `kv_final` and `kv_cancel`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import select
import time

from transfer.admission import OPEN, refused
from transfer.codec import decode, encode, unseal
from transfer.epochs import EpochGuard
from transfer.errors import HandshakeRequired, MalformedMessage, TransferError, TransportClosed
from transfer.importer import ImportResult, import_sequence
from transfer.messages import Ack, Manifest, Nack
from transfer.metrics import DEFAULT_METRICS, TransferMetrics
from transfer.ray_handshake import RayHandshakeMixin
from transfer.ray_stream_receiver import RayStreamMixin
from transfer.ray_wire import BLOCKS, CANCEL, FINAL, OFFER
from transfer.reblock import CompatPlan
from transfer.refusals import Refusals
from transfer.transport import TransportConfig
from transfer.wakeup import Wakeup

# a streamed transfer's channel calls -> their header kinds (ray_wire)
STREAM_CALLS = {"offer": OFFER, "blocks": BLOCKS, "final": FINAL, "cancel": CANCEL}

log = logging.getLogger(__name__)

class RayReceiverEndpoint(RayHandshakeMixin, RayStreamMixin):
    """Decode side. Call its methods from the actor that owns `manager` (one thread)."""

    def __init__(self, manager, config: TransportConfig | None = None, *, epochs: EpochGuard | None = None,
                 metrics: TransferMetrics | None = None, stage: bool = False, admission=OPEN):
        self.manager, self.config, self.stage = manager, config or TransportConfig(), stage
        self.admission = admission
        self.epochs = epochs if epochs is not None else EpochGuard()
        self.metrics = metrics or DEFAULT_METRICS
        self.refusals = Refusals(self.metrics, self.config.peer_name)
        self.fingerprint = manager.storage.layout.fingerprint()
        self.plans: dict[str, tuple[CompatPlan, str]] = {}  # connection -> (plan, sender's name)
        self._nonces: dict[str, float] = {}  # handshake nonces seen recently (no replays)
        self.pools: dict[str, object] = {}  # connection -> its same-node sender's pool (ray_shm.PeerPool)
        self._init_streams()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # (call, conn, args, future) from `deliver`
        self._committed: list[ImportResult] = []  # imports committed by inbox calls, not yet polled
        self.wakeup = Wakeup()

    # ---- the actor's threads ----------------------------------------------------------------------
    def deliver(self, call: str, conn: str, args: tuple) -> concurrent.futures.Future:
        """Queue one channel call for the owner's `poll` (any thread); its future gets the reply."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put((call, conn, args, future))
        self.wakeup.set()
        return future

    def kv(self, call: str, conn: str, *args) -> bytes:
        """The channel's one entry point, for an owner whose actor runs it on its own thread (a
        decode worker instead delivers the call to its loop: `deliver`)."""
        return self.handle(call, conn, args)[0]

    # ---- transfer.channel.ReceiverEndpoint -------------------------------------------------------------
    @property
    def address(self) -> str:
        return f"ray://{self.config.peer_name}"  # senders find the actor by this name

    def wake(self) -> None:
        self.wakeup.set()

    def poll(self, timeout: float) -> ImportResult | None:
        """Serve the delivered calls until one commits an import (returned), `timeout` passes or
        `wake()` is called (None). Streams gone idle (their prefill died) are aborted meanwhile."""
        deadline = time.monotonic() + timeout
        while True:
            while True:
                try:
                    call, conn, args, future = self._inbox.get_nowait()
                except queue.Empty:
                    break
                reply, result = self.handle(call, conn, args)
                if result is not None:
                    self._committed.append(result)
                future.set_result(reply)
            if self.expire_streams():
                log.warning("%s: an idle KV stream expired", self.config.peer_name)
            if self._committed:
                return self._committed.pop(0)
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.wakeup.fd], [], [], left)[0]:
                return None
            self.wakeup.clear()
            if self._inbox.empty():
                return None  # woken for the owner (a queued command)

    def handle(self, call: str, conn: str, args: tuple) -> tuple[bytes, ImportResult | None]:
        """One channel call: the reply bytes, and the import it committed (or None). Never raises:
        a call of the wrong shape is refused like any malformed message."""
        try:
            if call == "hello":
                (data,) = args
                return self.kv_hello(conn, data), None
            if call == "query":
                (data,) = args
                return self.kv_query(conn, data), None
            if call == "receive":
                return self.receive(conn, args[0], args[1:])
            if call == "receive_shm":
                manifest, offsets = args
                return self.receive(conn, manifest, (), offsets)
            if call in STREAM_CALLS:
                header, rest = args[0], args[1:]
                body = rest[0] if call in ("offer", "final") and len(rest) == 1 else b""
                frames = rest if call == "blocks" else ()
                if call in ("offer", "final") and len(rest) != 1 or call == "cancel" and rest:
                    raise MalformedMessage(f"{call} call with {len(rest)} arguments after its header")
                return self.stream_call(STREAM_CALLS[call], conn, header, body, frames)
            raise MalformedMessage(f"unknown channel call {str(call)[:32]!r}")
        except (TypeError, ValueError, IndexError, MalformedMessage) as e:
            if not isinstance(e, MalformedMessage):
                e = MalformedMessage(f"{str(call)[:32]!r}: a call of the wrong shape")
            return self._nack(e), None

    def abort_request(self, request_id: str) -> int:
        """The request was aborted: its streams end now, their reservation returned."""
        return self.abort_streams(request_id)

    def close(self) -> None:
        """Open streams end (their blocks returned); handshakes and mapped sender pools are forgotten;
        calls still queued are refused."""
        for request_id in {t.rpartition("/")[0] for t in self.in_flight()}:
            self.abort_streams(request_id)
        self.plans.clear()
        self.pools.clear()
        while not self._inbox.empty():
            self._inbox.get_nowait()[3].set_result(self._turn_away(TransportClosed("the receiver closed")))
        for result in self._committed:  # committed but never handed to the owner: returned
            self.manager.free(result.seq_id, uncache=True)
        self._committed.clear()

    def _nack(self, err: TransferError, request_id: str = "", epoch: int = 0, counted: bool = False) -> bytes:
        if not counted:
            self.metrics.record_error(err)
        return encode(Nack(request_id, epoch, err.code, str(err)))

    def receive(self, conn: str, manifest: bytes, frames, offsets: bytes | None = None
                ) -> tuple[bytes, ImportResult | None]:
        """Import one transfer: the reply for the sender, and the committed import (None on a nack),
        which the owner joins to its batch exactly as it does a ZeroMQ receiver's `poll` result.
        offsets: the frames' places in the sender's pool file (same node) instead of `frames`."""
        t0 = time.perf_counter()
        entry = self.handshaken(conn)
        if entry is None:  # NOTE: refused unread
            return self._turn_away(HandshakeRequired("transfer on a connection without a handshake")), None
        conn = str(conn)[:128]
        try:
            m = decode(unseal(manifest), self.config.limits, Manifest)
        except TransferError as e:
            return self._nack(e), None
        plan, peer = entry
        if not self.admission.admit_transfer(m.request_id, m.epoch, peer):
            return self._nack(refused()), None  # NOTE: before any block is allocated; no detail echoed
        if offsets is not None:
            try:
                pool = self.pools.get(str(conn))
                if pool is None:
                    raise HandshakeRequired("pool offsets on a connection without a mapped sender pool")
                frames = pool.frames(m, offsets)
            except TransferError as e:
                return self._nack(e, m.request_id, m.epoch), None
        try:
            make_room = getattr(self.admission, "make_room", None)
            res = import_sequence(self.manager, m, list(frames), plan, epochs=self.epochs,
                                  metrics=self.metrics, stage=self.stage, make_room=make_room)
        except TransferError as e:
            return self._nack(e, m.request_id, m.epoch, counted=True), None
        res.timings["receive_ms"] = (time.perf_counter() - t0) * 1e3
        return encode(Ack(res.request_id, res.epoch, res.new_blocks, res.reused_blocks, res.nbytes,
                          res.timings)), res


def make_receiver(manager, config, *, admission, port_min: int = 0, port_max: int = 0) -> RayReceiverEndpoint:
    """The registry's factory (Ray needs no port: senders find the worker's actor by name)."""
    return RayReceiverEndpoint(manager, config, admission=admission)
