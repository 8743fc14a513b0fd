"""GPU tier (skipped without CUDA): device pools export through pinned staging slots (the
device-to-host copy of chunk i+1 overlapping the send of chunk i) and import through a pinned
ring with asynchronous host-to-device copies; results must equal the source KV bit for bit."""

import threading

import pytest
import torch

from kvcache.storage import KVLayout
from measure.pools import fill_random_sequence, make_manager
from transfer.channels.zmq_channel import ZmqSender
from transfer.channels.zmq_receiver import ZmqReceiver
from transfer.export import ExportConfig, export_sequence
from transfer.importer import import_sequence
from transfer.transport import TransportConfig

pytestmark = pytest.mark.gpu
SHAPE = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "dtype": "bfloat16"}


def pool(B=16, device="cuda", n=128):
    return make_manager(KVLayout(block_size=B, **SHAPE), n, device=device)


def kv(manager, seq_id):
    t = manager.table(seq_id)
    slots = [t.slot(i, manager.block_size) for i in range(t.num_computed)]
    return manager.storage.read_slots(slots).contiguous().view(torch.uint8).cpu()


@pytest.mark.parametrize("src_dev, dst_dev, dst_bs", [("cuda", "cuda", 16), ("cuda", "cpu", 16),
                                                      ("cpu", "cuda", 16), ("cuda", "cuda", 32)])
def test_zmq_streaming_between_device_pools(src_dev, dst_dev, dst_bs):
    gen = torch.Generator().manual_seed(0)
    src, dst = pool(16, src_dev), pool(dst_bs, dst_dev)
    fill_random_sequence(src, "a", 700, gen)
    rx = ZmqReceiver(dst, TransportConfig(address="tcp://127.0.0.1:0"))
    out = []
    th = threading.Thread(target=lambda: out.append(rx.poll(60)))
    th.start()
    tx = ZmqSender(src.storage.layout.fingerprint(), TransportConfig(address=rx.address))
    try:
        cfg = ExportConfig(chunk_bytes=64 << 10, checksum_mode="inline")
        ex = export_sequence(src, "a", "r", 1, config=cfg)
        assert (ex.frames is None) == (src_dev == "cuda")
        tx.send(ex, timeout=60)
        th.join(60)
    finally:
        tx.close()
        rx.close()
    assert out and out[0].request_id == "r"
    assert torch.equal(kv(dst, "r"), kv(src, "a"))
    dst.check_integrity()
    src.check_integrity()


@pytest.mark.parametrize("dst_bs", [16, 8, 32])
def test_in_process_manifest_mode_device_to_device(dst_bs):
    gen = torch.Generator().manual_seed(1)
    src, dst = pool(16), pool(dst_bs, n=256)
    fill_random_sequence(src, "a", 333, gen)
    ex = export_sequence(src, "a", "r", 1, config=ExportConfig(chunk_bytes=1 << 20))  # staged, hashed
    import_sequence(dst, ex.manifest, ex.frames)
    ex.release()
    assert torch.equal(kv(dst, "r"), kv(src, "a"))
    dst.check_integrity()
