"""Tests for kvcache.manager on tiny pools, part two: swap round trips to a host pool (K/V bytes
and re-registered prefix blocks checked), host-pool shortage, usage accounting, misuse errors,
constructor checks, and check_integrity counting table references and catching corrupted
tables. Allocation, prefix caching, fork and copy-on-write are in test_manager.py."""

import pytest
import torch
from manager_helpers import D, H, L, make_manager, read_kv, same_state, snapshot, write_kv

from kvcache import BlockAllocator, IntegrityError, KVCacheManager, KVLayout, KVStorage


def test_swap_round_trip_preserves_kv_and_re_registers_prefix():
    m = make_manager(6, 2, host_blocks=4)
    m.allocate("a", [1, 2, 3, 4, 5])
    write_kv(m, "a", 0, 5, tag=100.0)
    m.mark_computed("a", 5)
    kv = read_kv(m, "a", 5)
    dev = m.storage.data[:3].clone()
    assert m.swap_out("a")
    a = m.table("a")
    assert a.swapped and a.blocks == [0, 1, 2]  # host ids
    assert torch.equal(m.host_storage.data[:3], dev)
    assert list(m.allocator._clean) == [3, 4, 5, 2] and list(m.allocator._evictable) == [1, 0]
    assert m.host_allocator.num_available == 1
    m.check_integrity()
    m.allocate("b", [9] * 8)  # reuses the device blocks that held 'a'
    assert m.table("b").blocks == [3, 4, 5, 2]
    write_kv(m, "b", 0, 8, tag=-500.0)
    host_before = m.host_allocator.num_available
    assert m.swap_in("a") is False  # 3 needed, 2 cached available: nothing changes
    assert a.swapped and a.blocks == [0, 1, 2] and m.host_allocator.num_available == host_before
    m.free("b")
    assert m.allocator.evict_cached() == 2  # clean queue [2, 5, 4, 3, 1, 0]
    assert m.swap_in("a")
    assert not a.swapped and a.blocks == [2, 5, 4]
    assert torch.equal(read_kv(m, "a", 5), kv)
    assert m.host_allocator.num_available == 4
    assert m.match_prefix([1, 2, 3, 4, 5]) == [2, 5]  # sealed blocks registered again
    m.check_integrity()


def test_swap_out_false_when_host_is_full():
    m = make_manager(4, 2, host_blocks=2)
    m.allocate("a", [1, 2, 3, 4, 5])
    snap = snapshot(m)
    assert m.swap_out("a") is False
    assert same_state(snapshot(m), snap) and not m.table("a").swapped
    assert m.host_allocator.num_available == 2


def test_swap_misuse_and_free_of_swapped_sequence():
    m = make_manager(4, 2)
    m.allocate("a", [1])
    with pytest.raises(ValueError, match="swap needs"):
        m.swap_out("a")
    m = make_manager(4, 2, host_blocks=4)
    m.allocate("a", [1, 2, 3])
    with pytest.raises(ValueError, match="not swapped out"):
        m.swap_in("a")
    assert m.swap_out("a")
    for op in (lambda: m.append("a", [4]), lambda: m.blocks_needed_to_append("a", 1),
               lambda: m.slot_mapping("a", 0, 1), lambda: m.fork("a", "b")):
        with pytest.raises(ValueError, match="swapped"):
            op()
    with pytest.raises(ValueError, match="already swapped out"):
        m.swap_out("a")
    assert m.allocator.num_used == 0 and m.host_allocator.num_used == 2
    m.free("a")
    assert m.host_allocator.num_used == 0 and m.tables == {}
    m.check_integrity()


def test_usage_reports_tail_waste_of_resident_tables():
    m = make_manager(10, 4, host_blocks=4)
    m.allocate("a", [1] * 5)  # 2 blocks, 3 empty slots
    m.allocate("b", [2] * 4)  # 1 block, full
    m.allocate("c", [3])  # 1 block, 3 empty slots
    m.allocate("d", [4] * 2)
    assert m.usage()["tail_waste_slots"] == 3 + 0 + 3 + 2
    m.swap_out("d")
    u = m.usage()
    assert u.pop("alloc_calls") == 4 and u.pop("alloc_seconds") > 0  # four timed allocate calls
    assert u == {"total_blocks": 10, "free_blocks": 6, "cached_blocks": 0, "used_blocks": 4,
                 "block_size": 4, "tail_waste_slots": 6, "swapped_sequences": 1}


def test_misuse_raises_value_error():
    m = make_manager(4, 2)
    m.allocate("a", [1, 2, 3])
    with pytest.raises(ValueError, match="already has a block table"):
        m.allocate("a", [1])
    with pytest.raises(ValueError, match="no tokens"):
        m.allocate("z", [])
    with pytest.raises(ValueError, match="free of unknown sequence"):
        m.free("z")
    with pytest.raises(ValueError, match="unknown sequence"):
        m.append("z", [1])
    with pytest.raises(ValueError, match="unknown sequence"):
        m.fork("z", "y")
    with pytest.raises(ValueError, match="already has a block table"):
        m.fork("a", "a")
    for start, end in ((-1, 1), (0, 4), (2, 1)):
        with pytest.raises(ValueError, match="token range"):
            m.slot_mapping("a", start, end)
    with pytest.raises(ValueError, match="already has a block table"):
        m.adopt("a", [2], [1])
    with pytest.raises(ValueError, match="cannot hold"):
        m.adopt("n", [2], [1, 2, 3])
    with pytest.raises(ValueError, match="not hold"):
        m.adopt("n", [2], [1])  # block 2 is free
    b = m.allocator.allocate()
    with pytest.raises(ValueError, match="twice"):
        m.adopt("n", [b, b], [1, 2, 3])
    assert "n" not in m.tables
    m.allocator.free(b)
    m.check_integrity()


def test_constructor_rejects_mismatched_pools():
    lay2, lay4 = KVLayout(L, H, D, 2), KVLayout(L, H, D, 2, dtype="float16")
    with pytest.raises(ValueError, match="number of blocks"):
        KVCacheManager(BlockAllocator(4), 2, KVStorage(lay2, 3))
    with pytest.raises(ValueError, match="block size"):
        KVCacheManager(BlockAllocator(4), 4, KVStorage(lay2, 4))
    with pytest.raises(ValueError, match="host storage"):
        KVCacheManager(BlockAllocator(4), 2, KVStorage(lay2, 4), host_storage=KVStorage(lay4, 4))
    with pytest.raises(ValueError, match="host storage block size"):
        KVCacheManager(BlockAllocator(4), 2, None, host_storage=KVStorage(KVLayout(L, H, D, 4), 4))


def test_check_integrity_counts_table_references():
    m = make_manager(6, 2, host_blocks=3)
    m.allocate("a", [1, 2, 3])
    m.fork("a", "b")
    m.allocate("c", [4])
    m.swap_out("c")
    m.check_integrity()
    lease = m.table("a").blocks[0]
    m.allocator.incref(lease)  # a reference held outside the tables (a migration lease)
    with pytest.raises(IntegrityError, match=f"block {lease}: ref count 3, tables name it 2"):
        m.check_integrity()
    m.check_integrity(extra_refs={lease: 1})
    m.allocator.free(lease)
    m.check_integrity()


def _table_corruptions():
    def names_free_block(m):
        m.table("a").blocks.append(5)
        m.table("a").token_ids += [0, 0]

    def names_block_twice(m):
        t = m.table("b")
        t.blocks[1] = t.blocks[0]

    def computed_past_end(m):
        m.table("a").num_computed = 4

    def lost_table(m):
        del m.tables["b"]

    def block_count_mismatch(m):
        m.table("a").token_ids += [9, 9]  # 5 tokens in 2 blocks of 2

    def sealed_uncomputed(m):
        m.table("a").block_hashes.append(123)

    def host_ref_drift(m):
        m.host_allocator.incref(m.table("c").blocks[0])

    def freed_behind_the_tables(m):
        m.allocator.free(m.table("d").blocks[0])

    return [names_free_block, names_block_twice, computed_past_end, lost_table, block_count_mismatch,
            sealed_uncomputed, host_ref_drift, freed_behind_the_tables]


@pytest.mark.parametrize("corrupt", _table_corruptions(), ids=lambda f: f.__name__)
def test_check_integrity_catches_table_corruption(corrupt):
    m = make_manager(6, 2, host_blocks=3)
    m.allocate("a", [1, 2, 3])  # blocks 0, 1
    m.mark_computed("a", 3)
    m.fork("a", "b")
    m.allocate("c", [4])
    m.swap_out("c")
    m.allocate("d", [5])
    m.check_integrity()
    corrupt(m)
    with pytest.raises(IntegrityError):
        m.check_integrity()


def test_group_swap_copies_shared_blocks_once_and_keeps_them_shared():
    """Two forks sharing two full blocks swap as one request: 2 shared + 2 private blocks leave the
    device (4 host blocks, not 6), come back shared, with every byte intact."""
    m = make_manager(8, 2, host_blocks=4)
    m.allocate("a", [1, 2, 3, 4, 5])
    write_kv(m, "a", 0, 5, tag=10.0)
    m.mark_computed("a", 5)
    m.fork("a", "b")
    m.append("b", [6])  # the shared partial tail is copied on write: b gets its own third block
    write_kv(m, "b", 4, 6, tag=50.0)
    kv = {seq: read_kv(m, seq, n) for seq, n in (("a", 5), ("b", 6))}
    assert m.table("a").blocks[:2] == m.table("b").blocks[:2]
    assert m.swap_out_group(["a", "b"])
    assert m.host_allocator.num_available == 0  # 4 distinct blocks, shared ones once
    host_a, host_b = m.table("a").blocks, m.table("b").blocks
    assert host_a[:2] == host_b[:2] and m.host_allocator.ref_count(host_a[0]) == 2
    assert m.allocator.num_used == 0
    m.check_integrity()
    assert m.swap_in_blocks(["a", "b"]) == 4
    assert m.swap_in_group(["a", "b"])
    assert m.table("a").blocks[:2] == m.table("b").blocks[:2]
    assert m.allocator.ref_count(m.table("a").blocks[0]) == 2 and m.allocator.num_used == 4
    assert all(torch.equal(read_kv(m, seq, n), kv[seq]) for seq, n in (("a", 5), ("b", 6)))
    assert m.host_allocator.num_available == 4
    m.check_integrity()


def test_group_swap_out_short_of_host_blocks_changes_nothing():
    m = make_manager(8, 2, host_blocks=3)
    m.allocate("a", [1, 2, 3, 4, 5])
    m.fork("a", "b")
    m.append("b", [6])
    snap = snapshot(m)
    assert m.swap_out_group(["a", "b"]) is False  # 4 distinct blocks, 3 host blocks
    assert same_state(snapshot(m), snap) and m.host_allocator.num_available == 3
