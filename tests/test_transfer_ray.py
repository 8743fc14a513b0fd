"""Ray transport (a few representative tests: Ray takes seconds to start): frames through the
object store into an actor's pool with re-blocking and dedupe, typed nacks back to the sender
with the actor's pool unchanged, and a dead receiver turning into a bounded TransferTimeout."""

import time

import pytest
import torch

from bench.pools import fill_random_sequence, kv_digest, make_manager
from bench.ray_receiver import PoolReceiver
from kvcache.storage import KVLayout
from transfer import errors as E
from transfer.export import ExportConfig, export_sequence
from transfer.lease import LeaseTable
from transfer.ray_channel import RaySender
from transfer.transport import TransportConfig

ray = pytest.importorskip("ray")
SHAPE = (2, 2, 8)  # layers, KV heads, head dim


def actor(block_size, n=64):
    return ray.remote(num_cpus=0.25)(PoolReceiver).remote((*SHAPE, block_size, "float16"), n)


def pool(block_size=16, head_dim=8):
    return make_manager(KVLayout(SHAPE[0], SHAPE[1], head_dim, block_size, "float16"), 64)


def test_ray_migrate_with_reblock_and_dedupe(ray_session):
    gen = torch.Generator().manual_seed(5)
    src, recv = pool(16), actor(32)
    tx = RaySender(src.storage.layout.fingerprint(), recv)
    assert tx.connect(timeout=60).reblock
    prefix = fill_random_sequence(src, "a", 100, gen)
    leases = LeaseTable()
    ack = tx.migrate(src, "a", "ra", 1, leases=leases, timeout=60)
    assert (ack.new_blocks, ack.reused_blocks) == (4, 0)
    assert ray.get(recv.digest.remote("ra")) == kv_digest(src, "a")
    fill_random_sequence(src, "b", 110, gen, token_ids=prefix[:96] + list(range(14)))
    ack = tx.migrate(src, "b", "rb", 1, leases=leases, timeout=60)
    assert ack.reused_blocks == 3 and ack.new_blocks == 1  # 96 shared tokens = 3 receiver blocks of 32
    assert ray.get(recv.digest.remote("rb")) == kv_digest(src, "b")
    stats = ray.get(recv.stats.remote())  # runs check_integrity inside the actor
    assert stats["tables"] == 2 and stats["metrics"]["counters"]["blocks_reused"] == 3
    assert leases.extra_refs() == {}
    src.check_integrity()


def test_ray_typed_nacks_leave_actor_pool_unchanged(ray_session):
    gen = torch.Generator().manual_seed(6)
    src, recv = pool(16), actor(16)
    with pytest.raises(E.FingerprintMismatch):
        RaySender(pool(head_dim=16).storage.layout.fingerprint(), recv).connect(timeout=60)
    tx = RaySender(src.storage.layout.fingerprint(), recv)
    fill_random_sequence(src, "a", 60, gen)
    tx.migrate(src, "a", "r", 2, timeout=60)
    ray.get(recv.free.remote("r"))
    before = ray.get(recv.stats.remote())
    ex = export_sequence(src, "a", "r2", 1, config=ExportConfig(checksum_mode="manifest"))
    ex.frames[0] = bytearray(ex.frames[0])
    ex.frames[0][5] ^= 1
    with pytest.raises(E.ChecksumError) as info:
        tx.send(ex, timeout=60)
    assert info.value.remote and ex.released
    with pytest.raises(E.StaleEpoch):
        tx.migrate(src, "a", "r", 2, timeout=60)
    after = ray.get(recv.stats.remote())
    assert {k: after[k] for k in ("free", "cached", "used", "tables")} == \
        {k: before[k] for k in ("free", "cached", "used", "tables")}
    assert after["metrics"]["errors"] == {"fingerprint": 1, "checksum": 1, "stale_epoch": 1}
    src.check_integrity()


def test_ray_dead_receiver_is_a_bounded_timeout(ray_session):
    src, recv = pool(16), actor(16)
    tx = RaySender(src.storage.layout.fingerprint(), recv, TransportConfig(checksum_mode="manifest"))
    tx.connect(timeout=60)
    ray.kill(recv)
    deadline = time.monotonic() + 30  # ray.kill returns before the actor is gone: wait until it is
    while time.monotonic() < deadline:
        try:
            ray.get(recv.stats.remote(), timeout=10)
        except ray.exceptions.RayError:
            break
        time.sleep(0.1)
    fill_random_sequence(src, "a", 20, torch.Generator().manual_seed(1))
    with pytest.raises(E.TransferTimeout):
        tx.migrate(src, "a", "r", 1, dedupe=False, timeout=20)
    assert tx.metrics.errors["timeout"] >= 1
