"""The Ray channel's same-node path (`transfer.pull`, way "shm"): a sender whose pool lives in
/dev/shm offers it at its first transfer, the receiving actor maps it, and each whole transfer
passes only the frames' offsets, copied once into the receiver's blocks (no payload chunk in any
actor call: the test's actor handle refuses them). A sender without such a pool pushes its chunks
through the object store. (Offsets outside the offered pool: tests/test_transfer_pull.py, the same
receiver code for every channel.)"""

import os

import msgpack
import pytest
import torch

from kvcache.storage import KVLayout
from measure.pools import fill_random_sequence, kv_digest, make_manager
from measure.ray_receiver import PoolReceiver
from transfer.channels.ray_channel import RaySender
from transfer.export import export_sequence
from transfer.transport import TransportConfig

ray = pytest.importorskip("ray")
LAYOUT = (2, 2, 8, 16, "float16")


class NoPayloadCalls:
    """An actor handle through which no payload chunk ("D" message) may go."""

    def __init__(self, handle):
        self._handle = handle
        self.kv = self

    def remote(self, conn, headers, *bodies):
        if any(h[:1] == b"D" for h in msgpack.unpackb(headers)):
            raise AssertionError("the payload went through the object store")
        return self._handle.kv.remote(conn, headers, *bodies)


def test_same_node_payload_is_read_from_the_senders_pool(ray_local):
    gen = torch.Generator().manual_seed(1)
    src = make_manager(KVLayout(*LAYOUT), 64, shm=True)
    assert src.storage.shm_path and os.path.exists(src.storage.shm_path)
    recv = ray.remote(num_cpus=0.25)(PoolReceiver).remote(LAYOUT, 64)
    tx = RaySender(src.storage.layout.fingerprint(), NoPayloadCalls(recv), pool=src.storage)
    tx.connect(timeout=60)
    first = [5, 6, 0, 9, 10, 11, 12]  # the free queue hands these out first: three runs
    blocks = src.allocator.allocate_many(64)
    src.allocator.free_many(first + [b for b in blocks if b not in first])
    tx.config = tx.channel.config = TransportConfig(checksum_mode="manifest", inline_bytes=0)  # all pulled
    for i, n in enumerate((100, 300)):  # several frames each
        fill_random_sequence(src, f"s{i}", n, gen)
        probe = export_sequence(src, f"s{i}", "probe", 1)
        assert len(probe.manifest.frames) >= (3 if i == 0 else 2)
        probe.release()
        ack = tx.migrate(src, f"s{i}", f"r{i}", 1, timeout=60)
        assert ack.new_blocks == -(-n // 16)
        assert ray.get(recv.digest.remote(f"r{i}")) == kv_digest(src, f"s{i}")
        assert tx.channel.pull  # the receiver mapped our pool file (offered at the first transfer)
    ray.get(recv.stats.remote())  # check_integrity inside the actor
    src.check_integrity()
    ray.kill(recv)


def test_without_a_shared_pool_the_object_store_carries_the_payload(ray_local):
    gen = torch.Generator().manual_seed(2)
    src = make_manager(KVLayout(*LAYOUT), 64)
    recv = ray.remote(num_cpus=0.25)(PoolReceiver).remote(LAYOUT, 64)
    tx = RaySender(src.storage.layout.fingerprint(), recv, pool=src.storage)
    tx.connect(timeout=60)
    fill_random_sequence(src, "a", 100, gen)
    tx.migrate(src, "a", "r", 1, timeout=60)
    assert not tx.channel.pull  # no pool file to offer: the chunks went in the calls
    assert ray.get(recv.digest.remote("r")) == kv_digest(src, "a")
    ray.kill(recv)
