"""Tests for kvcache.manager on tiny pools: exact block ids of tables, the slot formula, tail-first
release, prefix matching and revival, sealing of computed full blocks, fork, copy-on-write of a
shared partial tail (with the K/V bytes checked in storage), append shortage, swap round trips,
usage accounting, misuse errors and check_integrity."""

import pytest
import torch

from kvcache import BlockAllocator, IntegrityError, KVCacheManager, KVLayout, KVStorage

L, H, D = 2, 1, 2


def make(num_blocks: int, B: int, host_blocks: int = 0, caching: bool = True) -> KVCacheManager:
    lay = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, block_size=B)
    host = KVStorage(lay, host_blocks) if host_blocks else None
    return KVCacheManager(BlockAllocator(num_blocks), B, KVStorage(lay, num_blocks), caching, host)


def write(m: KVCacheManager, seq, start: int, end: int, tag: float) -> None:
    """Write distinct K/V for tokens start..end-1 through the sequence's table."""
    for t, slot in zip(range(start, end), m.slot_mapping(seq, start, end)):
        k = torch.full((L, H, D), tag + t)
        m.storage.write_slot(slot, k, -k)


def read(m: KVCacheManager, seq, end: int) -> torch.Tensor:
    return m.storage.read_slots(m.slot_mapping(seq, 0, end))  # (T, L, 2, H, D)


def refs(m: KVCacheManager) -> list[int]:
    return [m.allocator.ref_count(b) for b in range(m.allocator.num_blocks)]


def test_allocate_exact_blocks_and_slot_formula():
    m = make(6, 2)
    assert m.allocate("a", [1, 2, 3, 4, 5]) == 0
    a = m.table("a")
    assert a.blocks == [0, 1, 2] and a.tail_fill(2) == 1 and a.num_computed == 0
    m.allocate("b", [7, 8, 9])
    assert m.table("b").blocks == [3, 4] and m.table("b").tail_fill(2) == 1
    m.free("a")  # tail first: clean queue [5, 2, 1, 0]
    m.allocate("c", [6] * 5)
    c = m.table("c")
    assert c.blocks == [5, 2, 1]
    assert m.slot_mapping("c", 0, 5) == [10, 11, 4, 5, 2]  # table[t // B] * B + t % B
    assert all(c.slot(t, 2) == c.blocks[t // 2] * 2 + t % 2 for t in range(5))
    write(m, "c", 2, 3, tag=50.0)
    assert torch.equal(m.storage.data[2, :, 0, 0], torch.full((L, H, D), 52.0))
    m.check_integrity()


def test_free_releases_tail_first_so_the_tail_is_evicted_before_the_prefix():
    m = make(4, 2)
    m.allocate("a", [1, 2, 3, 4])
    m.mark_computed("a", 4)  # blocks 0 and 1 sealed
    h0, h1 = m.table("a").block_hashes
    m.free("a")  # evictable queue [1, 0], clean queue [2, 3]
    assert list(m.allocator._evictable) == [1, 0]
    m.allocate("b", [9, 9, 9, 9])
    assert m.table("b").blocks == [2, 3] and m.allocator.evictions == 0  # clean blocks first
    m.allocate("c", [8])
    assert m.table("c").blocks == [1]  # the tail of 'a' goes first
    assert m.allocator.lookup(h1) is None and m.allocator.lookup(h0) == 0
    m.free("b")
    assert m.allocate("d", [1, 2, 3, 4, 5]) == 2  # the prefix block survived
    assert m.table("d").blocks == [0, 3, 2]
    m.check_integrity()


def test_match_prefix_caps_at_len_minus_one_over_block_size():
    m = make(8, 2)
    m.allocate("a", [1, 2, 3, 4])
    assert m.match_prefix([1, 2, 3, 4, 5]) == []  # nothing computed yet
    m.mark_computed("a", 4)
    assert m.match_prefix([1, 2]) == []
    assert m.match_prefix([1, 2, 3]) == [0]
    assert m.match_prefix([1, 2, 3, 4]) == [0]  # (4 - 1) // 2 = 1: the last token is recomputed
    assert m.match_prefix([1, 2, 3, 4, 5]) == [0, 1]
    assert m.match_prefix([1, 9, 3, 4, 5]) == []
    assert m.match_prefix([1, 2, 9, 9, 5]) == [0]
    assert m.allocate("b", [1, 2, 3, 4]) == 2
    assert m.table("b").blocks == [0, 2] and m.table("b").num_computed == 2
    assert refs(m)[:3] == [2, 1, 1] and m.prefix_hit_tokens == 2
    m.mark_computed("b", 4)  # block 2 repeats block 1's prefix: the first copy stays canonical
    assert m.table("b").block_hashes == m.table("a").block_hashes
    assert m.allocator.hash_of(2) is None and m.allocator.lookup(m.table("a").block_hashes[1]) == 1
    m.check_integrity()


def test_prefix_hit_revives_cached_blocks():
    m = make(5, 2)
    m.allocate("a", [1, 2, 3, 4, 5])
    m.mark_computed("a", 5)
    m.free("a")  # evictable [1, 0], clean [3, 4, 2]
    assert (m.allocator.num_cached, m.allocator.num_free) == (2, 3)
    assert m.allocate("b", [1, 2, 3, 4, 6, 7]) == 4
    b = m.table("b")
    assert b.blocks == [0, 1, 3] and b.num_computed == 4
    assert b.block_hashes == m.prefix_hashes([1, 2, 3, 4])
    assert m.allocator.num_cached == 0 and refs(m) == [1, 1, 0, 1, 0]
    m.check_integrity()


def test_allocate_counts_revived_blocks_against_availability():
    m = make(3, 2)
    m.allocate("a", [1, 2, 3, 4, 5])
    m.mark_computed("a", 5)
    m.free("a")  # evictable [1, 0], clean [2]
    before = (list(m.allocator._clean), list(m.allocator._evictable), refs(m))
    # 2 revived + 2 new > 3 available
    assert m.allocate("b", [1, 2, 3, 4, 5, 6, 7]) is None
    assert "b" not in m.tables and m.prefix_hit_tokens == 0
    assert (list(m.allocator._clean), list(m.allocator._evictable), refs(m)) == before
    assert m.allocate("c", [1, 2, 3, 4, 5]) == 4
    assert m.table("c").blocks == [0, 1, 2]
    m.check_integrity()


def test_only_computed_full_blocks_are_registered():
    m = make(4, 2)
    m.allocate("a", [1, 2, 3, 4, 5])
    assert m.allocator.cached_hashes() == set()
    m.mark_computed("a", 3)
    assert len(m.table("a").block_hashes) == 1
    assert m.allocator.hash_of(0) is not None and m.allocator.hash_of(1) is None
    m.mark_computed("a", 5)
    assert [m.allocator.hash_of(b) for b in (0, 1)] == m.table("a").block_hashes
    assert m.allocator.hash_of(2) is None  # the partial tail is never shared
    m.mark_computed("a", 2)  # never goes back
    assert m.table("a").num_computed == 5
    with pytest.raises(ValueError, match="outside 0..5"):
        m.mark_computed("a", 6)
    with pytest.raises(ValueError, match="outside"):
        m.mark_computed("a", -1)


def test_extra_key_separates_prefix_caches():
    m = make(6, 2)
    m.allocate("a", [1, 2, 3, 4, 5], extra_key="x")
    m.mark_computed("a", 5)
    assert m.match_prefix([1, 2, 3, 4, 5]) == []
    assert m.match_prefix([1, 2, 3, 4, 5], "y") == []
    assert m.match_prefix([1, 2, 3, 4, 5], "x") == [0, 1]


def test_prefix_caching_disabled_shares_nothing():
    m = make(6, 2, caching=False)
    m.allocate("a", [1, 2, 3, 4, 5])
    m.mark_computed("a", 5)
    assert m.allocator.cached_hashes() == set() and m.table("a").block_hashes == []
    assert m.match_prefix([1, 2, 3, 4, 5]) == []
    assert m.allocate("b", [1, 2, 3, 4, 5]) == 0
    assert m.table("b").blocks == [3, 4, 5]


def test_fork_shares_every_block_with_one_more_reference():
    m = make(6, 2)
    m.allocate("a", [1, 2, 3])
    m.mark_computed("a", 3)
    m.fork("a", "b")
    a, b = m.table("a"), m.table("b")
    assert b.blocks == [0, 1] and refs(m) == [2, 2, 0, 0, 0, 0]
    assert (b.token_ids, b.num_computed, b.block_hashes) == (a.token_ids, 3, a.block_hashes)
    assert b.token_ids is not a.token_ids and b.blocks is not a.blocks
    m.check_integrity()
    m.free("a")
    assert refs(m) == [1, 1, 0, 0, 0, 0] and m.allocator.num_used == 2
    m.check_integrity()


def test_copy_on_write_of_a_shared_partial_tail():
    m = make(4, 4)
    m.allocate("a", [1, 2, 3])
    write(m, "a", 0, 3, tag=10.0)
    m.mark_computed("a", 3)
    a_kv = read(m, "a", 3)
    m.fork("a", "b")
    assert m.blocks_needed_to_append("b", 1) == 1
    before = m.storage.data.clone()
    assert m.append("b", [7])
    assert m.table("b").blocks == [1] and m.table("a").blocks == [0]
    assert m.cow_copies == 1 and refs(m) == [1, 1, 0, 0]
    assert torch.equal(m.storage.data[1, :, :, :3], before[0, :, :, :3])  # K/V copied
    assert torch.equal(m.storage.data[0], before[0])  # the original is intact
    assert m.slot_mapping("b", 3, 4) == [7]
    write(m, "b", 3, 4, tag=90.0)
    m.mark_computed("b", 4)
    assert torch.equal(read(m, "a", 3), a_kv)
    assert torch.equal(m.storage.data[0, :, :, 3], before[0, :, :, 3])
    assert torch.equal(read(m, "b", 3), a_kv)
    assert m.append("a", [8])  # a's tail is private now: written in place
    assert m.table("a").blocks == [0] and m.cow_copies == 1 and m.slot_mapping("a", 3, 4) == [3]
    m.check_integrity()


def test_shared_full_tail_needs_no_copy():
    m = make(4, 2)
    m.allocate("a", [1, 2])
    write(m, "a", 0, 2, tag=1.0)
    m.mark_computed("a", 2)
    m.fork("a", "b")
    before = m.storage.data.clone()
    assert m.blocks_needed_to_append("b", 1) == 1
    assert m.append("b", [3])
    assert m.table("b").blocks == [0, 1] and m.cow_copies == 0 and refs(m)[:2] == [2, 1]
    assert torch.equal(m.storage.data, before)
    m.check_integrity()


def _snapshot(m: KVCacheManager) -> tuple:
    return ({k: (list(t.blocks), list(t.token_ids), t.num_computed) for k, t in m.tables.items()},
            list(m.allocator._clean), list(m.allocator._evictable), refs(m), m.cow_copies,
            m.storage.data.clone())


def _same(x: tuple, y: tuple) -> bool:
    return x[:-1] == y[:-1] and torch.equal(x[-1], y[-1])


def test_append_shortage_changes_nothing():
    m = make(1, 2)
    m.allocate("a", [1, 2])
    snap = _snapshot(m)
    assert m.append("a", [3]) is False
    assert _same(_snapshot(m), snap)
    # Copy-on-write needs a block too.
    m = make(1, 4)
    m.allocate("a", [1, 2, 3])
    write(m, "a", 0, 3, tag=1.0)
    m.fork("a", "b")
    assert m.blocks_needed_to_append("b", 1) == 1 and m.blocks_needed_to_append("b", 2) == 2
    snap = _snapshot(m)
    assert m.append("b", [4]) is False
    assert _same(_snapshot(m), snap)
    # Room for the copy but not for the block after it.
    m = make(2, 2)
    m.allocate("a", [1])
    m.fork("a", "b")
    snap = _snapshot(m)
    assert m.append("b", [2, 3]) is False
    assert _same(_snapshot(m), snap)
    assert m.append("b", [2])
    assert m.table("b").blocks == [1] and m.cow_copies == 1
    m.check_integrity()


def test_append_of_nothing_is_a_no_op():
    m = make(3, 4)
    m.allocate("a", [1, 2, 3])
    m.fork("a", "b")
    assert m.blocks_needed_to_append("b", 0) == 0
    snap = _snapshot(m)
    assert m.append("b", []) is True
    assert _same(_snapshot(m), snap)
    with pytest.raises(ValueError, match="negative"):
        m.blocks_needed_to_append("b", -1)


def test_swap_round_trip_preserves_kv_and_re_registers_prefix():
    m = make(6, 2, host_blocks=4)
    m.allocate("a", [1, 2, 3, 4, 5])
    write(m, "a", 0, 5, tag=100.0)
    m.mark_computed("a", 5)
    kv = read(m, "a", 5)
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
    write(m, "b", 0, 8, tag=-500.0)
    host_before = m.host_allocator.num_available
    assert m.swap_in("a") is False  # 3 needed, 2 cached available: nothing changes
    assert a.swapped and a.blocks == [0, 1, 2] and m.host_allocator.num_available == host_before
    m.free("b")
    assert m.allocator.evict_cached() == 2  # clean queue [2, 5, 4, 3, 1, 0]
    assert m.swap_in("a")
    assert not a.swapped and a.blocks == [2, 5, 4]
    assert torch.equal(read(m, "a", 5), kv)
    assert m.host_allocator.num_available == 4
    assert m.match_prefix([1, 2, 3, 4, 5]) == [2, 5]  # sealed blocks registered again
    m.check_integrity()


def test_swap_out_false_when_host_is_full():
    m = make(4, 2, host_blocks=2)
    m.allocate("a", [1, 2, 3, 4, 5])
    snap = _snapshot(m)
    assert m.swap_out("a") is False
    assert _same(_snapshot(m), snap) and not m.table("a").swapped
    assert m.host_allocator.num_available == 2


def test_swap_misuse_and_free_of_swapped_sequence():
    m = make(4, 2)
    m.allocate("a", [1])
    with pytest.raises(ValueError, match="swap needs"):
        m.swap_out("a")
    m = make(4, 2, host_blocks=4)
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
    m = make(10, 4, host_blocks=4)
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


def test_adopt_makes_a_computed_sealed_table():
    m = make(4, 2)
    blocks = m.allocator.allocate_many(2)
    m.adopt("s", blocks, [1, 2, 3])
    s = m.table("s")
    assert s.blocks == [0, 1] and s.num_computed == 3 and len(s.block_hashes) == 1
    assert m.match_prefix([1, 2, 3]) == [0]
    m.check_integrity()


def test_misuse_raises_value_error():
    m = make(4, 2)
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
    m = make(6, 2, host_blocks=3)
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
    m = make(6, 2, host_blocks=3)
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
