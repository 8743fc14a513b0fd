"""ZeroMQ transport over real tcp:// and ipc:// sockets: handshake once per connection, full and
deduplicated migrations, re-blocking and staged (device-style) paths, typed nacks travelling
back to the sender, and a receiver that survives garbage, truncated or extra chunks, a wrong
checksum and a sender that vanishes mid-transfer, with its pool unchanged each time."""

import queue
import threading
import time

import msgpack
import pytest
import torch
import zmq

from bench.pools import fill_random_sequence, make_manager
from kvcache.storage import KVLayout
from transfer import errors as E
from transfer.checksum import checksum
from transfer.codec import encode
from transfer.export import ExportConfig, export_sequence
from transfer.lease import LeaseTable
from transfer.messages import PROTOCOL_VERSION, Hello
from transfer.metrics import TransferMetrics
from transfer.transport import TransportConfig, ipc_address
from transfer.zmq_transport import ZmqReceiver, ZmqSender
from transfer.zmq_wire import DATA, TOKEN

SHAPE = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16"}


def pool(B=16, n=64, **over):
    return make_manager(KVLayout(block_size=B, **{**SHAPE, **over}), n)


def kv(manager, seq_id):
    t = manager.table(seq_id)
    return manager.storage.read_slots([t.slot(i, manager.block_size) for i in range(t.num_computed)]) \
        .contiguous().view(torch.uint8)


def snapshot(manager):
    a = manager.allocator
    return (a.num_free, a.num_cached, a.num_used, sorted(manager.tables, key=str),
            [a.ref_count(b) for b in range(a.num_blocks)])


class Served:
    """A ZmqReceiver polled on a background thread; results and errors go to `events`.

    With auto_free, each imported sequence's KV is recorded and the sequence freed at once."""

    def __init__(self, manager, address="tcp://127.0.0.1:0", auto_free=False, **cfg):
        self.manager, self.metrics = manager, TransferMetrics()
        self.rx = ZmqReceiver(manager, TransportConfig(address=address, **cfg), metrics=self.metrics)
        self.events, self.kv, self.auto_free = queue.Queue(), {}, auto_free
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                res = self.rx.poll(0.05)
            except E.TransferError as e:
                self.events.put(e)
                continue
            if res is not None:
                if self.auto_free:
                    self.kv[res.seq_id] = kv(self.manager, res.seq_id)
                    self.manager.free(res.seq_id)
                self.events.put(res)

    def next(self, timeout=10.0):
        return self.events.get(timeout=timeout)

    def stop(self):
        self._stop.set()
        self.thread.join(10)
        self.rx.close()


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(11)


@pytest.mark.parametrize("kind", ["tcp", "ipc"])
def test_migrate_full_then_deduplicated(gen, kind):
    src, dst = pool(), pool()
    served = Served(dst, "tcp://127.0.0.1:0" if kind == "tcp" else ipc_address())
    cfg = TransportConfig(address=served.rx.address, chunk_bytes=4096)
    tx = ZmqSender(src.storage.layout.fingerprint(), cfg)
    try:
        assert tx.connect().dst_block_size == 16
        prefix = fill_random_sequence(src, "a", 100, gen)
        leases = LeaseTable()
        ack = tx.migrate(src, "a", "ra", 1, leases=leases)
        assert (ack.new_blocks, ack.reused_blocks, ack.nbytes) == (7, 0, 7 * 2048)
        assert served.next().request_id == "ra"
        fill_random_sequence(src, "b", 120, gen, token_ids=prefix[:96] + list(range(24)))
        ack = tx.migrate(src, "b", "rb", 1, leases=leases)
        assert ack.reused_blocks == 6 and ack.new_blocks == 2 and ack.nbytes == 2 * 2048
        assert served.next().request_id == "rb"
        assert leases.extra_refs() == {}  # acked: the leases were released
    finally:
        tx.close()
        served.stop()
    assert torch.equal(kv(dst, "ra"), kv(src, "a")) and torch.equal(kv(dst, "rb"), kv(src, "b"))
    assert dst.table("rb").blocks[:6] == dst.table("ra").blocks[:6]
    src.check_integrity()
    dst.check_integrity()


def test_reblock_and_staged_streaming(gen):
    src, dst = pool(16), pool(32)
    served = Served(dst, ipc_address())
    served.rx.stage = True  # import through the ring of host slots (device-pool path)
    tx = ZmqSender(src.storage.layout.fingerprint(), TransportConfig(address=served.rx.address))
    try:
        assert tx.connect().reblock
        fill_random_sequence(src, "a", 77, gen)
        ex = export_sequence(src, "a", "r", 1, config=ExportConfig(chunk_bytes=5000, checksum_mode="inline",
                                                                   stage=True))
        assert ex.frames is None  # streamed chunk by chunk through the staging ring
        assert tx.send(ex).new_blocks == 3
        served.next()
    finally:
        tx.close()
        served.stop()
    assert torch.equal(kv(dst, "r"), kv(src, "a"))
    dst.check_integrity()


def test_handshake_refuses_incompatible_layout(gen):
    dst = pool()
    served = Served(dst)
    tx = ZmqSender(pool(head_dim=16).storage.layout.fingerprint(), TransportConfig(address=served.rx.address))
    try:
        with pytest.raises(E.FingerprintMismatch) as info:
            tx.connect()
        assert info.value.remote
        assert isinstance(served.next(), E.FingerprintMismatch)
        assert tx.metrics.errors["fingerprint"] >= 1 and served.metrics.errors["fingerprint"] == 1
    finally:
        tx.close()
        served.stop()


def test_handshake_refuses_another_model_of_the_same_shape():
    """Equal shapes, different model identity: refused at the handshake, naming the field."""
    dst = make_manager(KVLayout(block_size=16, model="model-a", **SHAPE), 64)
    served = Served(dst)
    other = KVLayout(block_size=16, model="model-b", **SHAPE)
    tx = ZmqSender(other.fingerprint(), TransportConfig(address=served.rx.address))
    try:
        with pytest.raises(E.FingerprintMismatch, match="model"):
            tx.connect()
        assert isinstance(served.next(), E.FingerprintMismatch)
    finally:
        tx.close()
        served.stop()


class _OnlyReserved:
    """Admission as a decode worker gives it: one reserved (transfer id, epoch, sender)."""

    def admit_transfer(self, request_id, epoch, peer):
        return (request_id, epoch, peer) == ("r/0", 5, "prefill-0")

    def admit_query(self, request_id, peer):
        return (request_id, peer) == ("r/0", "prefill-0")


@pytest.mark.parametrize("request_id,epoch,peer", [("x/0", 5, "prefill-0"), ("r/0", 4, "prefill-0"),
                                                   ("r/0", 5, "intruder")])
def test_unadmitted_transfer_and_query_are_refused_before_any_allocation(gen, request_id, epoch, peer):
    src, dst = pool(), pool()
    fill_random_sequence(src, "a", 40, gen)
    fill_random_sequence(dst, "cached", 40, gen, src.table("a").token_ids)  # dst caches the same prefix
    dst.free("cached")
    served = Served(dst)
    served.rx.admission = _OnlyReserved()
    before = snapshot(dst)
    tx = ZmqSender(src.storage.layout.fingerprint(), TransportConfig(address=served.rx.address,
                                                                      peer_name=peer))
    try:
        if (request_id, peer) != ("r/0", "prefill-0"):  # a query carries no epoch
            with pytest.raises(E.NotAdmitted) as info:
                tx.query(request_id, src.table("a").token_ids)
            assert "refused" in str(info.value) and request_id not in str(info.value)
        with pytest.raises(E.NotAdmitted):
            tx.migrate(src, "a", request_id, epoch, dedupe=False)
        assert isinstance(served.next(), E.NotAdmitted)
        assert snapshot(dst) == before and served.metrics.errors["refused"] >= 1
        tx.config = TransportConfig(address=served.rx.address, peer_name="prefill-0")
        tx.connect()  # the reserved sender, same connection: admitted, and the dedupe hit is real
        assert tx.migrate(src, "a", "r/0", 5).reused_blocks == 2
    finally:
        tx.close()
        served.stop()


def test_stale_epoch_nack_reaches_sender_and_releases_lease(gen):
    src, dst = pool(), pool()
    served = Served(dst, auto_free=True)
    tx = ZmqSender(src.storage.layout.fingerprint(), TransportConfig(address=served.rx.address))
    try:
        fill_random_sequence(src, "a", 40, gen)
        tx.migrate(src, "a", "r", 3, dedupe=False)
        served.next()
        before = snapshot(dst)
        ex = export_sequence(src, "a", "r", 3)
        with pytest.raises(E.StaleEpoch) as info:
            tx.send(ex)
        assert info.value.remote and ex.released
        assert isinstance(served.next(), E.StaleEpoch)
        assert tx.migrate(src, "a", "r", 4, dedupe=False).epoch == 4
        served.next()
    finally:
        tx.close()
        served.stop()
    assert snapshot(dst) == before
    src.check_integrity()
    assert served.metrics.errors["stale_epoch"] == 1


def test_dedupe_miss_is_retried_in_full(gen):
    src, dst = pool(), pool()
    served = Served(dst, auto_free=True)  # imported sequences are freed: their blocks stay cached
    tx = ZmqSender(src.storage.layout.fingerprint(), TransportConfig(address=served.rx.address),
                   metrics=TransferMetrics())
    try:
        fill_random_sequence(src, "a", 64, gen)
        tx.migrate(src, "a", "r1", 1)
        served.next()
        query = tx.query

        def query_then_evict(*args, **kwargs):  # the receiver evicts between answering and importing
            held = query(*args, **kwargs)
            dst.allocator.evict_cached()
            return held

        tx.query = query_then_evict
        ack = tx.migrate(src, "a", "r2", 1)
        assert ack.reused_blocks == 0 and ack.new_blocks == 4
        assert isinstance(served.next(), E.DedupeMiss) and served.next().request_id == "r2"
        assert tx.metrics.errors["dedupe_miss"] == 1
    finally:
        tx.close()
        served.stop()
    assert torch.equal(served.kv["r2"], kv(src, "a"))
    src.check_integrity()
    dst.check_integrity()


class RawPeer:
    """A hand-driven DEALER for sending malformed traffic."""

    def __init__(self, address):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def hello(self, fingerprint):
        self.sock.send_multipart([b"H", encode(Hello(fingerprint))])
        assert self.sock.poll(5000)
        assert self.sock.recv_multipart()[0] == b"h"

    def reply(self):
        assert self.sock.poll(5000), "no reply"
        header, body = self.sock.recv_multipart()
        return header, msgpack.unpackb(body, raw=False)

    def close(self):
        self.sock.close(0)
        self.ctx.term()


def _stream(ex, token, tamper=None):
    """The messages of a transfer; `tamper(i, header, chunk)` returns the messages for chunk i."""
    msgs = [[TOKEN.pack(b"M", token), encode(ex.manifest)]]
    for i, (f, c, view, _) in enumerate(ex.chunks()):
        msg = [DATA.pack(b"D", token, f, c, checksum(view)), bytes(view)]
        msgs += tamper(i, *msg) if tamper else [msg]
    return msgs + [[TOKEN.pack(b"E", token), b""]]


def _manifest_version(ex, v):
    d = msgpack.unpackb(encode(ex.manifest), raw=False)
    d["v"] = v
    return msgpack.packb(d, use_bin_type=True)


WIRE_BAD = {  # 200 tokens of 128 bytes in 4096-byte chunks: chunks 0..6
    "truncated chunk": (lambda i, h, c: [[h, c[:-3]] if i == 1 else [h, c]], E.FrameSizeError),
    "extra chunk": (lambda i, h, c: [[h, c]] + ([[DATA.pack(b"D", 1, 0, 7, 0), c]] if i == 6 else []),
                    E.FrameCountError),
    "wrong checksum": (lambda i, h, c: [[h[:-8] + b"\0" * 8, c] if i == 2 else [h, c]], E.ChecksumError),
    "extra message part": (lambda i, h, c: [[h, c, b"junk"] if i == 0 else [h, c]], E.MalformedMessage),
}


@pytest.mark.parametrize("case", sorted(WIRE_BAD) + ["unknown version", "garbage", "vanishing sender",
                                                     "no handshake"])
def test_receiver_survives_bad_traffic_with_pool_unchanged(gen, case):
    src, dst = pool(), pool()
    fill_random_sequence(dst, "resident", 30, gen)
    before = snapshot(dst)
    served = Served(dst, idle_timeout_s=1.0)
    raw = RawPeer(served.rx.address)
    fill_random_sequence(src, "a", 200, gen)
    ex = export_sequence(src, "a", "r", 1, config=ExportConfig(chunk_bytes=4096, checksum_mode="inline"))
    assert ex.manifest.num_chunks == 7
    try:
        if case != "no handshake":
            raw.hello(src.storage.layout.fingerprint())
        if case in WIRE_BAD:
            tamper, err = WIRE_BAD[case]
            for msg in _stream(ex, 1, tamper):
                raw.sock.send_multipart(msg)
            header, nack = raw.reply()
            assert header == TOKEN.pack(b"A", 1) and nack["code"] == err.code
        elif case == "unknown version":
            err = E.ProtocolVersionError
            raw.sock.send_multipart([TOKEN.pack(b"M", 1), _manifest_version(ex, PROTOCOL_VERSION + 1)])
            assert raw.reply()[1]["code"] == "version"
        elif case == "no handshake":
            err = E.HandshakeRequired
            raw.sock.send_multipart(_stream(ex, 1)[0])
            assert raw.reply()[1]["code"] == "handshake"
        elif case == "garbage":
            err = E.MalformedMessage
            raw.sock.send_multipart([b"\xff\x00garbage", b"\x00" * 100])
            assert raw.reply()[1]["code"] == "malformed"
        else:  # the sender sends the manifest and two chunks, then is gone
            err = E.TransferTimeout
            for msg in _stream(ex, 1)[:3]:
                raw.sock.send_multipart(msg)
            raw.close()
        got = served.next()
        assert isinstance(got, err), got
        assert served.metrics.errors[err.code] == 1
        # the receiver is still healthy: a proper sender gets through afterwards
        tx = ZmqSender(src.storage.layout.fingerprint(), TransportConfig(address=served.rx.address))
        assert tx.migrate(src, "a", "ok", 1).new_blocks == 13
        assert served.next().request_id == "ok"
        tx.close()
    finally:
        if case != "vanishing sender":
            raw.close()
        served.stop()
    dst.free("ok")
    dst.allocator.evict_cached()  # the good import's blocks stayed cached for prefix reuse
    assert snapshot(dst) == before
    dst.check_integrity()


def test_sender_waits_are_bounded_and_timeout_keeps_the_lease(gen):
    src = pool()
    fill_random_sequence(src, "a", 40, gen)
    cfg = TransportConfig(address=ipc_address(), connect_timeout_s=0.2)
    tx = ZmqSender(src.storage.layout.fingerprint(), cfg, metrics=TransferMetrics())
    t0 = time.monotonic()
    with pytest.raises(E.TransferTimeout):
        tx.connect()
    assert time.monotonic() - t0 < 5
    tx.plan = object()  # pretend the handshake happened; the receiver never answers
    leases = LeaseTable()
    ex = export_sequence(src, "a", "r", 1, config=ExportConfig(checksum_mode="inline"))
    leases.add(ex)
    with pytest.raises(E.TransferTimeout):
        tx.send(ex, timeout=0.2)
    assert not ex.released and tx.metrics.errors["timeout"] == 2
    src.check_integrity(extra_refs=leases.extra_refs())
    assert leases.expire(now=ex.deadline + 1) == [("r", 1)]
    src.check_integrity()
    tx.close()
