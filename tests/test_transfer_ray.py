"""Ray transport: a dead receiver turns into a bounded TransferTimeout. What every transport must do
alike (frames landing bit-exact in an actor's pool with re-blocking and dedupe, typed nacks back
to the sender with the actor's pool unchanged) is in test_channel_conformance.py, the same-node
pool path in test_transfer_ray_shm.py."""

import time

import pytest
import torch

from kvcache.storage import KVLayout
from measure.pools import fill_random_sequence, make_manager
from measure.ray_receiver import PoolReceiver
from transfer import errors as E
from transfer.channels.ray_channel import RaySender
from transfer.transport import TransportConfig

ray = pytest.importorskip("ray")
SHAPE = (2, 2, 8)  # layers, KV heads, head dim


def actor(block_size, n=64):
    return ray.remote(num_cpus=0.25)(PoolReceiver).remote((*SHAPE, block_size, "float16"), n)


def pool(block_size=16, head_dim=8):
    return make_manager(KVLayout(SHAPE[0], SHAPE[1], head_dim, block_size, "float16"), 64)


def test_ray_dead_receiver_is_a_bounded_timeout(ray_local):
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
