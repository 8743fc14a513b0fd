"""Injected transfer faults (transfer.faults, driven by InjectFault in the chaos benchmark) are
each caught by a real ZeroMQ receiver: the corrupted or garbled transfer is refused with its typed
error, the receiver's pool is unchanged, the injection is counted, and the next clean transfer of
the same sequence lands intact."""

import pytest
import torch
from zmq_helpers import Served, kv_bytes, pool, snapshot

from measure.pools import fill_random_sequence
from transfer import errors as E
from transfer.channels.zmq_channel import ZmqSender
from transfer.faults import Faults
from transfer.transport import TransportConfig

EXPECT = {  # fault -> the receiver's typed error (None: the transfer still succeeds)
    "flip_payload": E.ChecksumError,
    "flip_manifest": E.ChecksumError,
    "drop_data": E.FrameCountError,
    "dup_data": E.FrameCountError,
    "reorder_data": E.FrameCountError,
    "delay_data": None,
    "delay_control": None,
    "dup_control": None,  # the receiver serves the first copy and ignores the second
}


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(11)


@pytest.mark.parametrize("kind", sorted(EXPECT))
def test_each_injected_fault_is_caught_or_harmless(gen, kind):
    src, dst = pool(), pool()
    fill_random_sequence(src, "a", 200, gen)  # 13 blocks, 7 chunks of 4096 bytes
    before = snapshot(dst)
    served = Served(dst, auto_free=True, idle_timeout_s=2.0)
    faults = Faults(delay_s=0.05)
    # inline_bytes 0: this small payload takes the bulk link, whose faults are under test
    config = TransportConfig(address=served.rx.address, chunk_bytes=4096, transfer_timeout_s=5.0,
                             inline_bytes=0)
    tx = ZmqSender(src.storage.layout.fingerprint(), config, faults=faults)
    try:
        faults.arm(kind)
        err = EXPECT[kind]
        if err is None:
            assert tx.migrate(src, "a", "r1", 1, dedupe=False).new_blocks == 13
            assert served.next().request_id == "r1"
        else:
            with pytest.raises(err):
                tx.migrate(src, "a", "r1", 1, dedupe=False)
            assert isinstance(served.next(), err)
            assert snapshot(dst) == before  # refused before adoption: nothing landed
        assert faults.injected[kind] == 1 and faults.take() is None
        tx.migrate(src, "a", "r2", 1, dedupe=False)  # the connection still works, intact
        assert served.next().request_id == "r2"
        link = tx.channel.bulk
        assert link is not None and link.sock is not None  # still on the bulk link
        assert torch.equal(served.kv["r2"], kv_bytes(src, "a"))
    finally:
        tx.close()
        served.stop()
    dst.allocator.evict_cached()
    assert snapshot(dst) == before


def test_a_dropped_manifest_is_a_bounded_timeout(gen):
    src, dst = pool(), pool()
    fill_random_sequence(src, "a", 40, gen)
    served = Served(dst, idle_timeout_s=1.0)
    faults = Faults()
    tx = ZmqSender(src.storage.layout.fingerprint(),
                   TransportConfig(address=served.rx.address, chunk_bytes=4096, transfer_timeout_s=1.0),
                   faults=faults)
    try:
        faults.arm("drop_control")
        with pytest.raises(E.TransferTimeout):
            tx.migrate(src, "a", "r1", 1, dedupe=False)
        assert faults.injected["drop_control"] == 1
        assert tx.migrate(src, "a", "r2", 1, dedupe=False).new_blocks == 3  # reconnected
    finally:
        tx.close()
        served.stop()


def test_unknown_fault_kinds_are_refused():
    with pytest.raises(ValueError):
        Faults().arm("meteor")
