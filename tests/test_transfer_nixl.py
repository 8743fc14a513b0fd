"""The NIXL channel (transfer.channels.nixl): ZeroMQ control, the payload read one-sided by the
receiver's own NIXL agent from the sender's registered pool, straight into its reserved blocks,
verified against the manifest's checksums. Bit-exact at several block sizes, including a sender
that re-blocks (its frames are then not pool memory: the bytes are pushed as before); a corrupted
pool read is caught by the checksum with the receiver's pool unchanged; without nixl the
transport fails with the install hint."""

import pytest
import torch

from kvcache.storage import KVLayout
from measure.pools import fill_random_sequence, make_manager
from tests.zmq_helpers import SHAPE, Served, kv_bytes, snapshot
from transfer import errors as E
from transfer import registry
from transfer.channels.nixl_pool import available
from transfer.transport import TransportConfig

pytestmark = pytest.mark.skipif(not available(), reason="nixl is not installed (pip install 'pdserve[nixl]')")


def _pair(src_block=16, dst_block=16, tokens=70):
    src = make_manager(KVLayout(block_size=src_block, **SHAPE), 64)
    fill_random_sequence(src, "a", tokens, torch.Generator().manual_seed(tokens), list(range(1, tokens + 1)))
    served = Served(make_manager(KVLayout(block_size=dst_block, **SHAPE), 64))
    nixl = registry.get("nixl")
    cfg = TransportConfig(address=served.rx.address, checksum_mode=nixl.checksum_mode, inline_bytes=0)
    return src, served, nixl.make_sender(src.storage.layout.fingerprint(), cfg, pool=src.storage)


@pytest.mark.parametrize("dst_block", [16, 32, 8])
def test_payload_is_read_from_the_senders_pool(dst_block):
    src, served, tx = _pair(dst_block=dst_block)
    try:
        tx.connect()
        tx.migrate(src, "a", "r1", 1, dedupe=False)
        assert tx.channel.pull  # the receiver's agent loaded ours (offered at the first transfer)
        result = served.next()
        assert result.request_id == "r1"
        assert torch.equal(kv_bytes(served.manager, "r1"), kv_bytes(src, "a"))
        tx.migrate(src, "a", "r2", 1)  # the prefix is held now: only the tail moves
        assert served.next().reused_blocks > 0
    finally:
        tx.close()
        served.stop()


def test_a_corrupted_read_fails_its_checksum_and_leaves_the_pool_unchanged(monkeypatch):
    from transfer.channels import nixl as nixl_channel

    src, served, tx = _pair()
    real = nixl_channel.NixlSource.read_many

    def flipped(self, items, threads=1):
        landed = real(self, items, threads)
        items[-1][1][0][0] ^= 1  # as if a bit of the last chunk flipped on the way
        return landed

    monkeypatch.setattr(nixl_channel.NixlSource, "read_many", flipped)
    try:
        tx.connect()
        before = snapshot(served.manager)
        with pytest.raises(E.ChecksumError):
            tx.migrate(src, "a", "r1", 1, dedupe=False)
        assert isinstance(served.next(), E.ChecksumError)
        assert snapshot(served.manager) == before
    finally:
        tx.close()
        served.stop()
