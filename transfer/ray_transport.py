"""Ray transport: control through actor calls; payload frames read straight from the sender's pool
on one node, through Ray's object store across nodes. Implements `transfer.transport`.

Same node (`ray_shm`): a sender whose pool lives in /dev/shm names the file in its handshake; a
receiver that can map it answers with the same path, and each transfer then passes only the
frames' byte offsets (`kv_receive_shm`), which the receiver copies from once into its blocks.
Otherwise (another node, a device pool, a re-blocked copy, a chaos fault): sender side
(`RaySender`): each frame, a numpy view over pool memory (or over a staging buffer for device
pools), is an argument of one actor call beside the msgpack manifest; Ray copies it once into
the object store (frames under 100 KiB travel inline with the call). Receiver side
(`RayReceiverEndpoint`, a plain object living inside the decode worker's actor): Ray hands the
frames over as read-only numpy arrays mapped from shared memory (zero-copy), which
`import_sequence` copies once into the reserved blocks. Our own messages cross as msgpack bytes;
Ray serializes the call itself. The receiving actor exposes `kv_hello(conn, bytes)`,
`kv_query(conn, bytes)`, `kv_receive(conn, manifest, *frames)` and `kv_receive_shm(conn,
manifest, offsets)`, each returning msgpack bytes, and for streamed migrations (`ray_stream`,
`ray_stream_receiver`) `kv_offer`, `kv_blocks`, `kv_final` and `kv_cancel`.
"""

from __future__ import annotations

import logging
import time
import uuid

import numpy as np

from transfer.admission import OPEN, refused
from transfer.blocks import prefix_hashes_at
from transfer.codec import decode, decode_reply, encode, seal, unseal
from transfer.epochs import EpochGuard
from transfer.errors import (
    HandshakeRequired,
    MalformedMessage,
    TransferError,
    TransferTimeout,
)
from transfer.export import ExportedSequence
from transfer.importer import ImportResult, import_sequence
from transfer.messages import Ack, Held, HelloReply, Manifest, Nack, Query
from transfer.metrics import DEFAULT_METRICS, TransferMetrics
from transfer.ray_handshake import RayHandshakeMixin
from transfer.ray_shm import encode_offsets, pool_offsets
from transfer.ray_stream import migrate_streamed
from transfer.ray_stream_receiver import RayStreamMixin
from transfer.reblock import CompatPlan, check_compatible
from transfer.refusals import Refusals
from transfer.transport import TransportConfig, check_reply, make_hello, migrate

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


class RaySender:
    """Prefill side: one connection to a receiving actor (any actor exposing the kv_* methods)."""

    def __init__(self, fingerprint: dict, actor, config: TransportConfig | None = None, *,
                 metrics: TransferMetrics | None = None, faults=None, pool=None):
        self.fingerprint, self.actor = dict(fingerprint), actor
        self.pool = pool  # this side's KVStorage: in /dev/shm, a same-node receiver reads frames from it
        self.shm = False  # the receiver mapped our pool at the handshake
        self.faults = faults  # transfer.faults.Faults (chaos benchmark), or None
        self.config = config or TransportConfig(checksum_mode="manifest")
        self.metrics = metrics or DEFAULT_METRICS
        self.conn = uuid.uuid4().hex
        self.plan: CompatPlan | None = None
        self.last_phases: dict[str, float] = {}  # of the last migration (transport.migrate)
        self.stream_token = 0  # streamed migrations on this connection so far

    def _get(self, ref, timeout: float, what: str):
        import ray

        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref)
            err = TransferTimeout(f"no {what} from the receiving actor within {timeout}s")
        except ray.exceptions.RayError as e:  # the actor died or raised
            err = TransferTimeout(f"receiving actor failed during {what}: {type(e).__name__}")
        self.metrics.record_error(err)
        raise err

    def connect(self, timeout: float | None = None) -> CompatPlan:
        path = getattr(self.pool, "shm_path", None) or ""
        hello = make_hello(self.fingerprint, self.config, pool_path=path)
        data = self._get(self.actor.kv_hello.remote(self.conn, encode(hello)),
                         timeout or self.config.connect_timeout_s, "handshake reply")
        reply = _reply_of(self, data, HelloReply)
        try:
            check_reply(reply, hello, self.config)  # signed for this hello, by the receiver we meant
            self.plan = check_compatible(self.fingerprint, reply.fingerprint)
            self.shm = bool(path) and reply.data_path == path
        except TransferError as e:
            self.metrics.record_error(e)
            raise
        return self.plan

    def query(self, request_id: str, token_ids, extra_key: str | None = None,
              timeout: float | None = None) -> list[int]:
        plan = self.plan or self.connect(timeout)
        hashes = prefix_hashes_at(token_ids, plan.dst_block_size, extra_key)
        if not hashes:
            return []
        q = encode(Query(str(request_id), plan.dst_block_size, tuple(hashes)))
        data = self._get(self.actor.kv_query.remote(self.conn, q), timeout or self.config.connect_timeout_s,
                         "dedupe reply")
        held = _reply_of(self, data, Held).held
        if any(not 0 <= i < len(hashes) for i in held):
            err = MalformedMessage("dedupe reply names blocks outside the query")
            self.metrics.record_error(err)
            raise err
        return sorted(set(held))

    def send(self, exported: ExportedSequence, timeout: float | None = None) -> Ack:
        """Call the receiver with the manifest and frames; wait (bounded) for its answer."""
        if self.plan is None:
            self.connect()
        m = exported.manifest
        if exported.frames is None:
            raise ValueError("the Ray transport needs host frames: export with checksum_mode='manifest'")
        timeout = timeout or self.config.transfer_timeout_s
        bodies, frames = [seal(encode(m))], list(enumerate(exported.frames))
        fault = self.faults.take() if self.faults is not None else None
        if fault is not None:  # chaos benchmark: whole frames are this transport's data messages
            bodies, frames = self.faults.manifest(fault, bodies[0]), list(self.faults.chunks(fault, frames))
        if not bodies:  # a dropped call: the sender waits out its bound, as for a lost message
            time.sleep(timeout)
            err = TransferTimeout(f"no ack from the receiving actor within {timeout}s")
            self.metrics.record_error(err)
            raise err
        offsets = pool_offsets(self.pool, exported.frames) if self.shm and fault is None else None
        if offsets is not None:  # same node: the receiver copies the frames out of our pool file
            calls = [self.actor.kv_receive_shm.remote(self.conn, bodies[0], encode_offsets(offsets))]
        else:  # Ray copies each frame into its object store when the call is submitted (small ones
            # travel inline with the call); the receiver reads them zero-copy from shared memory
            args = [np.frombuffer(f, dtype=np.uint8) for _, f in frames]
            calls = [self.actor.kv_receive.remote(self.conn, body, *args) for body in bodies]
        data = self._get(calls[-1], timeout, "ack")  # timeout: lease kept
        try:
            ack = _reply_of(self, data, Ack)
        finally:
            exported.release()
        self.metrics.add("transfers")
        self.metrics.add("bytes_sent", m.payload_bytes)
        return ack

    def close(self) -> None:
        """Nothing held open (actor calls); the next migration handshakes again."""
        self.plan = None

    def migrate_streamed(self, manager, request_id: str, epoch: int, token_ids: list[int], sampling: dict,
                         feed, extra_key: str | None = None, timeout: float | None = None) -> Ack:
        """A streamed migration with `ZmqSender.migrate_streamed`'s contract (`transfer.ray_stream`)."""
        return migrate_streamed(self, manager, request_id, epoch, token_ids, sampling, feed, extra_key,
                                timeout)

    def migrate(self, manager, seq_id, request_id: str, epoch: int, state=None, *, dedupe: bool = True,
                leases=None, timeout: float | None = None, lease: bool = True) -> Ack:
        """Dedupe query, export (checksums in the manifest), send; see `transport.migrate`."""
        return migrate(self, manager, seq_id, request_id, epoch, state, dedupe=dedupe, leases=leases,
                       timeout=timeout, checksum_mode="manifest", lease=lease)


def _reply_of(sender, data: bytes, cls):
    return decode_reply(data, cls, sender.config.limits, sender.metrics)
