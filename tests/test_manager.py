"""Tests for kvcache.manager on tiny pools: exact block ids of tables, the slot formula, tail-first
release, prefix matching and revival, sealing of computed full blocks, fork, copy-on-write of a
shared partial tail (with the K/V bytes checked in storage), append shortage and adopt. Swap,
usage accounting, misuse errors and check_integrity are in test_manager_swap_checks.py."""

import pytest
import torch
from manager_helpers import D, H, L, make_manager, read_kv, ref_counts, same_state, snapshot, write_kv


def test_allocate_exact_blocks_and_slot_formula():
    m = make_manager(6, 2)
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
    write_kv(m, "c", 2, 3, tag=50.0)
    assert torch.equal(m.storage.data[2, :, 0, 0], torch.full((L, H, D), 52.0))
    m.check_integrity()


def test_free_releases_tail_first_so_the_tail_is_evicted_before_the_prefix():
    m = make_manager(4, 2)
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
    m = make_manager(8, 2)
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
    assert ref_counts(m)[:3] == [2, 1, 1] and m.prefix_hit_tokens == 2
    m.mark_computed("b", 4)  # block 2 repeats block 1's prefix: the first copy stays canonical
    assert m.table("b").block_hashes == m.table("a").block_hashes
    assert m.allocator.hash_of(2) is None and m.allocator.lookup(m.table("a").block_hashes[1]) == 1
    m.check_integrity()


def test_prefix_hit_revives_cached_blocks():
    m = make_manager(5, 2)
    m.allocate("a", [1, 2, 3, 4, 5])
    m.mark_computed("a", 5)
    m.free("a")  # evictable [1, 0], clean [3, 4, 2]
    assert (m.allocator.num_cached, m.allocator.num_free) == (2, 3)
    assert m.allocate("b", [1, 2, 3, 4, 6, 7]) == 4
    b = m.table("b")
    assert b.blocks == [0, 1, 3] and b.num_computed == 4
    assert b.block_hashes == m.prefix_hashes([1, 2, 3, 4])
    assert m.allocator.num_cached == 0 and ref_counts(m) == [1, 1, 0, 1, 0]
    m.check_integrity()


def test_allocate_counts_revived_blocks_against_availability():
    m = make_manager(3, 2)
    m.allocate("a", [1, 2, 3, 4, 5])
    m.mark_computed("a", 5)
    m.free("a")  # evictable [1, 0], clean [2]
    before = (list(m.allocator._clean), list(m.allocator._evictable), ref_counts(m))
    # 2 revived + 2 new > 3 available
    assert m.allocate("b", [1, 2, 3, 4, 5, 6, 7]) is None
    assert "b" not in m.tables and m.prefix_hit_tokens == 0
    assert (list(m.allocator._clean), list(m.allocator._evictable), ref_counts(m)) == before
    assert m.allocate("c", [1, 2, 3, 4, 5]) == 4
    assert m.table("c").blocks == [0, 1, 2]
    m.check_integrity()


def test_only_computed_full_blocks_are_registered():
    m = make_manager(4, 2)
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
    m = make_manager(6, 2)
    m.allocate("a", [1, 2, 3, 4, 5], extra_key="x")
    m.mark_computed("a", 5)
    assert m.match_prefix([1, 2, 3, 4, 5]) == []
    assert m.match_prefix([1, 2, 3, 4, 5], "y") == []
    assert m.match_prefix([1, 2, 3, 4, 5], "x") == [0, 1]


def test_prefix_caching_disabled_shares_nothing():
    m = make_manager(6, 2, caching=False)
    m.allocate("a", [1, 2, 3, 4, 5])
    m.mark_computed("a", 5)
    assert m.allocator.cached_hashes() == set() and m.table("a").block_hashes == []
    assert m.match_prefix([1, 2, 3, 4, 5]) == []
    assert m.allocate("b", [1, 2, 3, 4, 5]) == 0
    assert m.table("b").blocks == [3, 4, 5]


def test_fork_shares_every_block_with_one_more_reference():
    m = make_manager(6, 2)
    m.allocate("a", [1, 2, 3])
    m.mark_computed("a", 3)
    m.fork("a", "b")
    a, b = m.table("a"), m.table("b")
    assert b.blocks == [0, 1] and ref_counts(m) == [2, 2, 0, 0, 0, 0]
    assert (b.token_ids, b.num_computed, b.block_hashes) == (a.token_ids, 3, a.block_hashes)
    assert b.token_ids is not a.token_ids and b.blocks is not a.blocks
    m.check_integrity()
    m.free("a")
    assert ref_counts(m) == [1, 1, 0, 0, 0, 0] and m.allocator.num_used == 2
    m.check_integrity()


def test_copy_on_write_of_a_shared_partial_tail():
    m = make_manager(4, 4)
    m.allocate("a", [1, 2, 3])
    write_kv(m, "a", 0, 3, tag=10.0)
    m.mark_computed("a", 3)
    a_kv = read_kv(m, "a", 3)
    m.fork("a", "b")
    assert m.blocks_needed_to_append("b", 1) == 1
    before = m.storage.data.clone()
    assert m.append("b", [7])
    assert m.table("b").blocks == [1] and m.table("a").blocks == [0]
    assert m.cow_copies == 1 and ref_counts(m) == [1, 1, 0, 0]
    assert torch.equal(m.storage.data[1, :, :, :3], before[0, :, :, :3])  # K/V copied
    assert torch.equal(m.storage.data[0], before[0])  # the original is intact
    assert m.slot_mapping("b", 3, 4) == [7]
    write_kv(m, "b", 3, 4, tag=90.0)
    m.mark_computed("b", 4)
    assert torch.equal(read_kv(m, "a", 3), a_kv)
    assert torch.equal(m.storage.data[0, :, :, 3], before[0, :, :, 3])
    assert torch.equal(read_kv(m, "b", 3), a_kv)
    assert m.append("a", [8])  # a's tail is private now: written in place
    assert m.table("a").blocks == [0] and m.cow_copies == 1 and m.slot_mapping("a", 3, 4) == [3]
    m.check_integrity()


def test_shared_full_tail_needs_no_copy():
    m = make_manager(4, 2)
    m.allocate("a", [1, 2])
    write_kv(m, "a", 0, 2, tag=1.0)
    m.mark_computed("a", 2)
    m.fork("a", "b")
    before = m.storage.data.clone()
    assert m.blocks_needed_to_append("b", 1) == 1
    assert m.append("b", [3])
    assert m.table("b").blocks == [0, 1] and m.cow_copies == 0 and ref_counts(m)[:2] == [2, 1]
    assert torch.equal(m.storage.data, before)
    m.check_integrity()


def test_append_shortage_changes_nothing():
    m = make_manager(1, 2)
    m.allocate("a", [1, 2])
    snap = snapshot(m)
    assert m.append("a", [3]) is False
    assert same_state(snapshot(m), snap)
    # Copy-on-write needs a block too.
    m = make_manager(1, 4)
    m.allocate("a", [1, 2, 3])
    write_kv(m, "a", 0, 3, tag=1.0)
    m.fork("a", "b")
    assert m.blocks_needed_to_append("b", 1) == 1 and m.blocks_needed_to_append("b", 2) == 2
    snap = snapshot(m)
    assert m.append("b", [4]) is False
    assert same_state(snapshot(m), snap)
    # Room for the copy but not for the block after it.
    m = make_manager(2, 2)
    m.allocate("a", [1])
    m.fork("a", "b")
    snap = snapshot(m)
    assert m.append("b", [2, 3]) is False
    assert same_state(snapshot(m), snap)
    assert m.append("b", [2])
    assert m.table("b").blocks == [1] and m.cow_copies == 1
    m.check_integrity()


def test_append_of_nothing_is_a_no_op():
    m = make_manager(3, 4)
    m.allocate("a", [1, 2, 3])
    m.fork("a", "b")
    assert m.blocks_needed_to_append("b", 0) == 0
    snap = snapshot(m)
    assert m.append("b", []) is True
    assert same_state(snapshot(m), snap)
    with pytest.raises(ValueError, match="negative"):
        m.blocks_needed_to_append("b", -1)


def test_adopt_makes_a_computed_sealed_table():
    m = make_manager(4, 2)
    blocks = m.allocator.allocate_many(2)
    m.adopt("s", blocks, [1, 2, 3])
    s = m.table("s")
    assert s.blocks == [0, 1] and s.num_computed == 3 and len(s.block_hashes) == 1
    assert m.match_prefix([1, 2, 3]) == [0]
    m.check_integrity()
