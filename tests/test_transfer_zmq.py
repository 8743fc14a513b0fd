"""ZeroMQ transport over real tcp:// and ipc:// sockets: handshake once per connection, full and
deduplicated migrations (queried, or in one round trip), re-blocking and staged (device-style)
paths, a dedupe miss retried in full, and bounded sender waits. What every transport must do
alike (typed refusals of an incompatible layout or model, an unadmitted transfer or a stale
epoch, with the receiver's pool unchanged) is in test_channel_conformance.py; malformed traffic
against the receiver is in test_transfer_zmq_wire.py."""

import time

import pytest
import torch
from zmq_helpers import Served, kv_bytes, pool

from measure.pools import fill_random_sequence
from transfer import errors as E
from transfer.channels.zmq_channel import ZmqSender
from transfer.export import ExportConfig, export_sequence
from transfer.lease import LeaseTable
from transfer.metrics import TransferMetrics
from transfer.transport import TransportConfig, ipc_address


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(11)


@pytest.mark.parametrize("inline", [0, 1 << 20], ids=["queried", "one-round-trip"])
@pytest.mark.parametrize("kind", ["tcp", "ipc"])
def test_migrate_full_then_deduplicated(gen, kind, inline):
    """Queried (inline_bytes 0): the shared prefix is not sent. One round trip (payload under
    inline_bytes): no query, every byte is sent, and the receiver shares the prefix it holds."""
    src, dst = pool(), pool()
    served = Served(dst, "tcp://127.0.0.1:0" if kind == "tcp" else ipc_address(), inline_bytes=inline)
    cfg = TransportConfig(address=served.rx.address, chunk_bytes=4096, inline_bytes=inline)
    tx = ZmqSender(src.storage.layout.fingerprint(), cfg)
    queries, real_query = [], tx.query_steps  # (the sans-IO steps `migrate` runs)
    tx.query_steps = lambda *a, **k: queries.append(a) or real_query(*a, **k)
    try:
        assert tx.connect().dst_block_size == 16
        prefix = fill_random_sequence(src, "a", 100, gen)
        leases = LeaseTable()
        ack = tx.migrate(src, "a", "ra", 1, leases=leases)
        assert (ack.new_blocks, ack.reused_blocks, ack.nbytes) == (7, 0, 7 * 2048)
        assert served.next().request_id == "ra"
        fill_random_sequence(src, "b", 120, gen, token_ids=prefix[:96] + list(range(24)))
        ack = tx.migrate(src, "b", "rb", 1, leases=leases)
        sent = 2 if inline == 0 else 8
        assert (ack.reused_blocks, ack.new_blocks, ack.nbytes) == (6, 2, sent * 2048)
        assert len(queries) == (2 if inline == 0 else 0)
        assert served.next().request_id == "rb"
        assert leases.extra_refs() == {}  # acked: the leases were released
    finally:
        tx.close()
        served.stop()
    assert torch.equal(kv_bytes(dst, "ra"), kv_bytes(src, "a"))
    assert torch.equal(kv_bytes(dst, "rb"), kv_bytes(src, "b"))
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
    assert torch.equal(kv_bytes(dst, "r"), kv_bytes(src, "a"))
    dst.check_integrity()


def test_dedupe_miss_is_retried_in_full(gen):
    src, dst = pool(), pool()
    served = Served(dst, auto_free=True)  # imported sequences are freed: their blocks stay cached
    config = TransportConfig(address=served.rx.address, inline_bytes=0)  # this small payload is queried first
    tx = ZmqSender(src.storage.layout.fingerprint(), config, metrics=TransferMetrics())
    try:
        fill_random_sequence(src, "a", 64, gen)
        tx.migrate(src, "a", "r1", 1)
        served.next()
        query = tx.query_steps  # (the sans-IO steps `migrate` runs)

        def query_then_evict(*args, **kwargs):  # the receiver evicts between answering and importing
            held = yield from query(*args, **kwargs)
            dst.allocator.evict_cached()
            return held

        tx.query_steps = query_then_evict
        ack = tx.migrate(src, "a", "r2", 1)
        assert ack.reused_blocks == 0 and ack.new_blocks == 4
        assert isinstance(served.next(), E.DedupeMiss) and served.next().request_id == "r2"
        assert tx.metrics.errors["dedupe_miss"] == 1
    finally:
        tx.close()
        served.stop()
    assert torch.equal(served.kv["r2"], kv_bytes(src, "a"))
    src.check_integrity()
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
