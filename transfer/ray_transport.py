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

import logging
import time

from transfer.admission import OPEN, refused
from transfer.codec import decode, encode, unseal
from transfer.epochs import EpochGuard
from transfer.errors import HandshakeRequired, TransferError
from transfer.importer import ImportResult, import_sequence
from transfer.messages import Ack, Manifest, Nack
from transfer.metrics import DEFAULT_METRICS, TransferMetrics
from transfer.ray_handshake import RayHandshakeMixin
from transfer.ray_stream_receiver import RayStreamMixin
from transfer.reblock import CompatPlan
from transfer.refusals import Refusals
from transfer.transport import TransportConfig

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

    # ---- transfer.channel.ReceiverEndpoint: imports arrive as the owner's calls, not through poll
    @property
    def address(self) -> str:
        return f"ray://{self.config.peer_name}"  # senders find the actor by this name

    def poll(self, timeout: float) -> None:
        """Housekeeping only, returning at once: streams gone idle (their prefill died) are aborted,
        their blocks returned. Committed imports come back from `receive` and `stream_call`."""
        if self.expire_streams():
            log.warning("%s: an idle KV stream expired", self.config.peer_name)
        return None

    def abort_request(self, request_id: str) -> int:
        """The request was aborted: its streams end now, their reservation returned."""
        return self.abort_streams(request_id)

    def close(self) -> None:
        """Open streams end (their blocks returned); handshakes and mapped sender pools are forgotten."""
        for request_id in {t.rpartition("/")[0] for t in self.in_flight()}:
            self.abort_streams(request_id)
        self.plans.clear()
        self.pools.clear()

    def _nack(self, err: TransferError, request_id: str = "", epoch: int = 0, counted: bool = False) -> bytes:
        if not counted:
            self.metrics.record_error(err)
        return encode(Nack(request_id, epoch, err.code, str(err)))

    def kv_receive(self, conn: str, manifest: bytes, *frames) -> bytes:
        """The actor-facing call: the reply bytes only (see `receive`)."""
        return self.receive(conn, manifest, frames)[0]

    def kv_receive_shm(self, conn: str, manifest: bytes, offsets: bytes) -> bytes:
        """Same node: the frames lie at `offsets` in the sender's pool file (see `receive`)."""
        return self.receive(conn, manifest, (), offsets)[0]

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
