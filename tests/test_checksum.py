"""Checksums on several threads (transfer.checksum.checksum_many) give the digests one thread
gives, item by item and in order, and an export hashed on two threads carries the same manifest
checksums as one hashed on one."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.storage import KVLayout
from measure.pools import fill_random_sequence, make_manager
from transfer import checksum as C
from transfer.export import ExportConfig, export_sequence

items = st.lists(st.lists(st.binary(max_size=300), max_size=4), max_size=12)


@settings(max_examples=60, deadline=None)
@given(items)
def test_many_on_two_threads_equals_one_by_one(parts):
    C.PARALLEL_MIN_BYTES, saved = 0, C.PARALLEL_MIN_BYTES  # hand even small items to the pool
    try:
        got = C.checksum_many(parts, threads=2)
    finally:
        C.PARALLEL_MIN_BYTES = saved
    assert got == [C.checksum(b"".join(p)) for p in parts]


def test_an_export_hashed_on_two_threads_has_the_same_manifest(monkeypatch):
    monkeypatch.setattr(C, "PARALLEL_MIN_BYTES", 0)
    layout = KVLayout(block_size=16, num_layers=4, num_kv_heads=4, head_dim=64, dtype="float16")
    src = make_manager(layout, 80)  # 32 KiB blocks: 70 blocks, 2.2 MiB
    fill_random_sequence(src, "a", 1100, torch.Generator().manual_seed(5), list(range(1, 1101)))
    one, two = (export_sequence(src, "a", "r", 1, config=ExportConfig(
        chunk_bytes=64 << 10, checksum_threads=t, lease=False)) for t in (1, 2))
    assert two.manifest.frames == one.manifest.frames
    assert sum(len(f.checksums) for f in one.manifest.frames) > 8
