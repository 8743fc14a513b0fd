"""Re-blocking on the sender (`transfer.export_reblock`): an export for a receiver with another
block size carries receiver-sized blocks, which the receiver lands straight in its own blocks
(no staging, no re-block copy at commit). The KV is exact for any pair of sizes, with and
without a dedupe answer and on the staged (device-style) receive path; over a real ZeroMQ
connection `migrate` re-blocks by itself; a manifest whose frames claim another block size
than the receiver's is refused before anything is reserved."""

import dataclasses

import pytest
import torch
from zmq_helpers import Served, kv_bytes, pool, snapshot
from zmq_helpers import kv_bytes as kv

from measure.pools import fill_random_sequence
from transfer import errors as E
from transfer.blocks import prefix_hashes_at
from transfer.channels.zmq_channel import ZmqSender
from transfer.export import ExportConfig, export_sequence
from transfer.importer import ImportSession, import_sequence
from transfer.transport import TransportConfig


@pytest.mark.parametrize("src_bs,dst_bs", [(16, 32), (32, 16), (16, 8), (8, 16), (16, 24)])
@pytest.mark.parametrize("stage", [False, True])
def test_reblocked_export_lands_directly_and_exactly(src_bs, dst_bs, stage):
    gen = torch.Generator().manual_seed(src_bs * 100 + dst_bs)
    src, dst = pool(src_bs), pool(dst_bs)
    tokens = fill_random_sequence(src, "a", 77, gen)
    ex = export_sequence(src, "a", "r", 1, config=ExportConfig(chunk_bytes=4096), frame_block_size=dst_bs)
    m = ex.manifest
    assert m.frame_block_size == dst_bs and sum(f.num_blocks for f in m.frames) == -(-77 // dst_bs)
    assert ex.held_blocks == []  # a copy: no lease on the sender's pool
    session = ImportSession(dst, m)
    assert session.checked.direct and session.staging is None  # lands in the reserved blocks
    session.abort()
    res = import_sequence(dst, m, ex.frames, stage=stage)
    assert res.new_blocks == -(-77 // dst_bs) and dst.table("r").token_ids == tokens
    assert torch.equal(kv(dst, "r"), kv(src, "a"))
    dst.check_integrity()
    src.check_integrity()


@pytest.mark.parametrize("dst_bs", [32, 8])
def test_reblocked_export_sends_only_the_receiver_blocks_it_lacks(dst_bs):
    gen = torch.Generator().manual_seed(dst_bs)
    src, dst = pool(16), pool(dst_bs)
    prefix = fill_random_sequence(src, "a", 64, gen)
    ex = export_sequence(src, "a", "ra", 1, frame_block_size=dst_bs)
    import_sequence(dst, ex.manifest, ex.frames)
    tokens = fill_random_sequence(src, "b", 90, gen, token_ids=prefix + list(range(26)))
    held = [i for i, h in enumerate(prefix_hashes_at(tokens, dst_bs)) if dst.allocator.lookup(h) is not None]
    assert held == list(range(64 // dst_bs))
    ex = export_sequence(src, "b", "rb", 1, reuse=held, reuse_block_size=dst_bs, frame_block_size=dst_bs)
    assert sum(f.num_blocks for f in ex.manifest.frames) == -(-90 // dst_bs) - len(held)
    res = import_sequence(dst, ex.manifest, ex.frames)
    assert res.reused_blocks == len(held)
    assert dst.table("rb").blocks[:len(held)] == dst.table("ra").blocks[:len(held)]
    assert torch.equal(kv(dst, "rb"), kv(src, "b"))
    dst.check_integrity()


def test_frames_in_another_block_size_are_refused_before_reserving():
    gen = torch.Generator().manual_seed(1)
    src, dst = pool(16), pool(32)
    fill_random_sequence(src, "a", 77, gen)
    before = snapshot(dst)
    ex = export_sequence(src, "a", "r", 1, frame_block_size=8)  # the receiver's blocks are 32
    with pytest.raises(E.MalformedMessage, match="re-blocked to 8"):
        import_sequence(dst, ex.manifest, ex.frames)
    ex = export_sequence(src, "a", "r", 1, frame_block_size=32)
    lying = dataclasses.replace(ex.manifest, frame_block_size=0)  # receiver blocks, claimed as sender's
    with pytest.raises(E.MalformedMessage):
        import_sequence(dst, lying, ex.frames)
    assert snapshot(dst) == before


def test_migrate_reblocks_on_the_sender_over_zmq():
    gen = torch.Generator().manual_seed(2)
    src, dst = pool(16), pool(32)
    fill_random_sequence(src, "a", 200, gen)
    served = Served(dst, auto_free=True, inline_bytes=0)
    config = TransportConfig(address=served.rx.address, chunk_bytes=4096, inline_bytes=0)
    tx = ZmqSender(src.storage.layout.fingerprint(), config)
    try:
        ack = tx.migrate(src, "a", "r", 1)
        assert ack.new_blocks == 7 and ack.nbytes == 7 * 32 * 128  # receiver blocks went on the wire
        assert served.next().request_id == "r"
    finally:
        tx.close()
        served.stop()
    assert torch.equal(served.kv["r"], kv_bytes(src, "a"))


@pytest.mark.parametrize("reblock_on_sender", [False, True])
def test_a_transfer_whose_every_block_is_reused_commits(reblock_on_sender):
    """Nothing to send at 16 -> 8 (a zero-byte payload): the import shares every block."""
    gen = torch.Generator().manual_seed(3)
    src, dst = pool(16), pool(8)
    fill_random_sequence(src, "a", 64, gen)
    ex = export_sequence(src, "a", "ra", 1, frame_block_size=8)
    import_sequence(dst, ex.manifest, ex.frames)
    ex = export_sequence(src, "a", "rb", 1, reuse=list(range(8)), reuse_block_size=8,
                         frame_block_size=8 if reblock_on_sender else 0)
    assert ex.manifest.payload_bytes == 0
    res = import_sequence(dst, ex.manifest, ex.frames)
    assert (res.new_blocks, res.reused_blocks) == (0, 8)
    assert torch.equal(kv(dst, "rb"), kv(src, "a"))
    dst.check_integrity()
