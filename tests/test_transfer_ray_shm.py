"""The Ray transport's same-node path (`transfer.ray_shm`): a sender whose pool lives in /dev/shm
names it at the handshake, the receiving actor maps it, and each transfer passes only the frames'
offsets, copied once into the receiver's blocks (no payload in the actor call: the test's actor
handle refuses the "receive" call). A sender without such a pool, or one naming a file that is not a
pdserve pool, stays on the object store; offsets outside the sender's pool or of the wrong count
are refused with the receiver's pool unchanged."""

import os

import pytest
import torch

from bench.pools import fill_random_sequence, kv_digest, make_manager
from bench.ray_receiver import PoolReceiver
from kvcache.storage import KVLayout
from transfer import errors as E
from transfer.codec import decode, encode, seal
from transfer.export import ExportConfig, export_sequence
from transfer.messages import HelloReply, Nack
from transfer.ray_channel import RaySender
from transfer.ray_shm import encode_offsets, pool_offsets
from transfer.ray_transport import RayReceiverEndpoint
from transfer.transport import TransportConfig, make_hello

ray = pytest.importorskip("ray")
LAYOUT = (2, 2, 8, 16, "float16")


class NoPayloadCalls:
    """An actor handle whose "receive" call (payload in the call) must not be used."""

    def __init__(self, handle):
        self._handle = handle
        self.kv = self

    def remote(self, call, *args):
        if call == "receive":
            raise AssertionError("the payload went through the object store")
        return self._handle.kv.remote(call, *args)


def test_same_node_payload_is_read_from_the_senders_pool(ray_session):
    gen = torch.Generator().manual_seed(1)
    src = make_manager(KVLayout(*LAYOUT), 64, shm=True)
    assert src.storage.shm_path and os.path.exists(src.storage.shm_path)
    recv = ray.remote(num_cpus=0.25)(PoolReceiver).remote(LAYOUT, 64)
    tx = RaySender(src.storage.layout.fingerprint(), NoPayloadCalls(recv), pool=src.storage)
    tx.connect(timeout=60)
    assert tx.channel.shm
    first = [5, 6, 0, 9, 10, 11, 12]  # the free queue hands these out first: three runs
    blocks = src.allocator.allocate_many(64)
    src.allocator.free_many(first + [b for b in blocks if b not in first])
    tx.config = TransportConfig(checksum_mode="manifest", inline_bytes=0)
    for i, n in enumerate((100, 300)):  # several frames each
        fill_random_sequence(src, f"s{i}", n, gen)
        probe = export_sequence(src, f"s{i}", "probe", 1)
        assert len(probe.manifest.frames) >= (3 if i == 0 else 2)
        probe.release()
        ack = tx.migrate(src, f"s{i}", f"r{i}", 1, timeout=60)
        assert ack.new_blocks == -(-n // 16)
        assert ray.get(recv.digest.remote(f"r{i}")) == kv_digest(src, f"s{i}")
    ray.get(recv.stats.remote())  # check_integrity inside the actor
    src.check_integrity()
    ray.kill(recv)


def test_without_a_shared_pool_the_object_store_carries_the_payload(ray_session):
    gen = torch.Generator().manual_seed(2)
    src = make_manager(KVLayout(*LAYOUT), 64)
    recv = ray.remote(num_cpus=0.25)(PoolReceiver).remote(LAYOUT, 64)
    tx = RaySender(src.storage.layout.fingerprint(), recv, pool=src.storage)
    tx.connect(timeout=60)
    assert not tx.channel.shm
    fill_random_sequence(src, "a", 100, gen)
    tx.migrate(src, "a", "r", 1, timeout=60)
    assert ray.get(recv.digest.remote("r")) == kv_digest(src, "a")
    ray.kill(recv)


def _endpoint():
    dst = make_manager(KVLayout(*LAYOUT), 64)
    return dst, RayReceiverEndpoint(dst, TransportConfig())


def test_a_file_that_is_not_a_pool_is_not_mapped(tmp_path):
    src = make_manager(KVLayout(*LAYOUT), 8)
    dst, rx = _endpoint()
    for path in ("/etc/passwd", str(tmp_path / "pdserve-kv-1-x"), "/dev/shm/../etc/passwd"):
        reply = decode(rx.kv_hello("c", encode(make_hello(src.storage.layout.fingerprint(), TransportConfig(),
                                                          pool_path=path))))
        assert isinstance(reply, HelloReply) and reply.data_path == "" and "c" not in rx.pools


@pytest.mark.parametrize("case", ["beyond the pool", "one offset short", "no mapped pool"])
def test_bad_offsets_are_refused_and_the_pool_is_unchanged(case):
    gen = torch.Generator().manual_seed(3)
    src = make_manager(KVLayout(*LAYOUT), 16, shm=True)
    fill_random_sequence(src, "a", 100, gen)
    dst, rx = _endpoint()
    conn = "c" if case != "no mapped pool" else "d"
    rx.kv_hello("c", encode(make_hello(src.storage.layout.fingerprint(), TransportConfig(),
                                       pool_path=src.storage.shm_path)))
    rx.kv_hello("d", encode(make_hello(src.storage.layout.fingerprint(), TransportConfig())))
    assert rx.pools["c"].path == src.storage.shm_path and "d" not in rx.pools
    ex = export_sequence(src, "a", "r", 1, config=ExportConfig(checksum_mode="manifest"))
    offsets = pool_offsets(src.storage, ex.frames)
    if case == "beyond the pool":
        offsets = [os.path.getsize(src.storage.shm_path) - 100] * len(offsets)
    elif case == "one offset short":
        offsets = offsets[:-1] if len(offsets) > 1 else []
    before = (dst.allocator.num_free, dst.allocator.num_cached, dict(dst.tables))
    reply = decode(rx.kv("receive_shm", conn, seal(encode(ex.manifest)), encode_offsets(offsets)))
    want = E.HandshakeRequired if case == "no mapped pool" else E.MalformedMessage
    assert isinstance(reply, Nack) and reply.code == want.code
    assert (dst.allocator.num_free, dst.allocator.num_cached, dict(dst.tables)) == before
    # the honest offsets import exactly
    good = pool_offsets(src.storage, ex.frames)
    reply = decode(rx.kv("receive_shm", "c", seal(encode(ex.manifest)), encode_offsets(good)))
    assert not isinstance(reply, Nack)
    assert kv_digest(dst, "r") == kv_digest(src, "a")
    dst.check_integrity()
