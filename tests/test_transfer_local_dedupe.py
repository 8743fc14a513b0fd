"""A small transfer skips the dedupe query (one round trip), so its sender sends every block; the
receiver still shares the prefix blocks it caches (`import_checks.cached_prefix`), lands their
bytes in staging and drops them. The shared blocks keep their own bytes even when the sent copy
differs, the new blocks get exactly the sender's KV, at equal and unequal block sizes, and above
the size limit nothing is shared (every block lands fresh)."""

import pytest
import torch
from zmq_helpers import kv_bytes as kv
from zmq_helpers import pool

from measure.pools import fill_random_sequence
from transfer.export import ExportConfig, export_sequence
from transfer.importer import ImportSession, import_sequence


@pytest.mark.parametrize("src_bs,dst_bs", [(16, 16), (16, 32), (32, 16)])
def test_unqueried_import_shares_the_cached_prefix_and_keeps_its_bytes(src_bs, dst_bs):
    gen = torch.Generator().manual_seed(7)
    src, dst = pool(src_bs), pool(dst_bs)
    tokens = torch.randint(0, 50_000, (100,), generator=gen).tolist()
    # the receiver computed the first 64 tokens itself: same tokens, different KV bytes
    fill_random_sequence(dst, "resident", 64, gen, token_ids=tokens[:64])
    held = list(dst.table("resident").blocks[:64 // dst_bs])
    resident = kv(dst, "resident").clone()
    fill_random_sequence(src, "a", 100, gen, token_ids=tokens)
    ex = export_sequence(src, "a", "r", 1, config=ExportConfig(checksum_mode="manifest"))
    assert ex.manifest.reuse == () and sum(f.num_blocks for f in ex.manifest.frames) == -(-100 // src_bs)
    res = import_sequence(dst, ex.manifest, ex.frames)
    ex.release()
    assert res.reused_blocks == len(held) == 64 // dst_bs
    table = dst.table("r")
    assert table.blocks[:len(held)] == held  # shared, not copied
    assert torch.equal(kv(dst, "resident"), resident)  # the dropped copy did not overwrite them
    assert torch.equal(kv(dst, "r")[64:], kv(src, "a")[64:])  # the rest is the sender's KV
    assert torch.equal(kv(dst, "r")[:64], resident)
    dst.check_integrity()


def test_above_the_limit_nothing_is_shared():
    gen = torch.Generator().manual_seed(8)
    src, dst = pool(), pool()
    tokens = torch.randint(0, 50_000, (100,), generator=gen).tolist()
    fill_random_sequence(dst, "resident", 64, gen, token_ids=tokens[:64])
    fill_random_sequence(src, "a", 100, gen, token_ids=tokens)
    ex = export_sequence(src, "a", "r", 1, config=ExportConfig(checksum_mode="manifest"))
    s = ImportSession(dst, ex.manifest, local_dedupe_bytes=ex.manifest.payload_bytes - 1)
    assert len(s.dst_blocks) == 7 and not set(s.dst_blocks) & set(dst.table("resident").blocks)
    s.abort()
    ex.release()
    dst.check_integrity()
