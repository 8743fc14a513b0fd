"""Tests for kvcache.allocator on tiny pools: exact block ids in allocate, free and reuse order, the
clean/evictable queues, prefix-hash registration and chaining, misuse errors, and
check_integrity on valid and deliberately corrupted states."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvcache import BlockAllocator, IntegrityError, hash_block
from kvcache.allocator import ROOT_HASH


def state(a: BlockAllocator) -> tuple:
    """Everything observable about the free list, for 'nothing changed' checks."""
    return (list(a._clean), list(a._evictable), list(a._ref), dict(a._hash_of), a.evictions)


def test_allocate_hands_out_ids_in_order_then_none():
    a = BlockAllocator(4)
    assert [a.allocate() for _ in range(4)] == [0, 1, 2, 3]
    assert a.allocate() is None
    assert a.num_used == 4 and a.num_free == 0 and a.num_available == 0
    assert [a.ref_count(b) for b in range(4)] == [1, 1, 1, 1]
    a.check_integrity({0: 1, 1: 1, 2: 1, 3: 1})


def test_free_uncached_drops_the_hash_and_makes_the_block_clean():
    a = BlockAllocator(3)
    b0, b1 = a.allocate(), a.allocate()
    assert a.register(b0, 11) and a.register(b1, 22)
    a.free(b0)  # cached as usual
    a.free(b1, uncache=True)  # nobody vouches for its KV: not reachable by its hash any more
    assert a.lookup(11) == b0 and a.lookup(22) is None
    assert list(a._clean) == [2, b1] and list(a._evictable) == [b0]
    a.check_integrity()
    b2 = a.allocate()
    a.incref(b2)
    assert a.register(b2, 33)
    a.free_many([b2, b2], uncache=True)
    assert a.lookup(33) is None
    a.check_integrity()


def test_clean_queue_is_fifo():
    a = BlockAllocator(5)
    assert [a.allocate() for _ in range(3)] == [0, 1, 2]  # clean queue now [3, 4]
    a.free(1)
    a.free(0)  # clean queue [3, 4, 1, 0]
    assert [a.allocate() for _ in range(4)] == [3, 4, 1, 0]
    assert a.allocate() is None


def test_cached_blocks_evicted_only_when_no_clean_block_is_left_oldest_first():
    a = BlockAllocator(4)
    assert a.allocate_many(4) == [0, 1, 2, 3]
    assert a.register(0, 100) and a.register(1, 101)
    a.free_many([1, 0])  # tail first: evictable queue [1, 0]
    a.free(2)  # clean queue [2]
    assert (a.num_free, a.num_cached, a.num_used) == (1, 2, 1)
    a.check_integrity({3: 1})
    assert a.allocate() == 2  # a clean block first, although the cached ones were released earlier
    assert a.evictions == 0
    assert a.allocate() == 1  # then the oldest released cached block
    assert a.evictions == 1 and a.lookup(101) is None and a.hash_of(1) is None
    assert a.lookup(100) == 0
    assert a.allocate() == 0
    assert a.lookup(100) is None and a.evictions == 2
    assert a.allocate() is None
    a.check_integrity({0: 1, 1: 1, 2: 1, 3: 1})


def test_acquire_cached_revives_and_refreshes_lru_position():
    a = BlockAllocator(3)
    a.allocate_many(3)
    for b in range(3):
        a.register(b, 200 + b)
    a.free_many([0, 1, 2])  # evictable [0, 1, 2]
    assert a.acquire_cached(200) == 0  # revived: out of the queue, ref 1
    assert a.ref_count(0) == 1 and a.num_cached == 2 and a.num_used == 1
    assert a.acquire_cached(200) == 0  # a used block just gains a reference
    assert a.ref_count(0) == 2
    assert a.acquire_cached(999) is None
    a.free(0)
    a.free(0)  # released again: now the most recent, evictable [1, 2, 0]
    assert a.evict_cached(2) == 2
    assert a.lookup(201) is None and a.lookup(202) is None and a.lookup(200) == 0
    assert list(a._clean) == [1, 2]
    assert a.evict_cached() == 1 and a.num_cached == 0
    assert list(a._clean) == [1, 2, 0] and a.evictions == 3
    a.check_integrity({})


def test_allocate_many_all_or_nothing():
    a = BlockAllocator(4)
    assert a.allocate_many(2) == [0, 1]
    a.register(1, 7)
    a.free(1)  # available: clean [2, 3] + cached [1]
    before = state(a)
    assert a.allocate_many(4) is None
    assert state(a) == before
    assert a.allocate_many(0) == []
    assert a.allocate_many(3) == [2, 3, 1]  # clean first, then the cached block is evicted
    assert a.lookup(7) is None
    with pytest.raises(ValueError, match="negative"):
        a.allocate_many(-1)


def test_register_rules():
    a = BlockAllocator(3)
    a.allocate_many(2)
    assert a.register(0, 5) is True
    assert a.register(1, 5) is False  # the first copy stays canonical
    assert a.register(0, 6) is False  # a block holds one hash
    assert a.lookup(5) == 0 and a.hash_of(1) is None and a.lookup(6) is None
    assert a.cached_hashes() == {5}
    with pytest.raises(ValueError, match="not in use"):
        a.register(2, 9)
    a.free(0)
    assert a.num_cached == 1 and a.cached_hashes() == {5}  # cached hashes stay listed


def test_hash_chain_is_stable_and_sensitive():
    h1 = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert h1 == hash_block(ROOT_HASH, np.array([1, 2, 3, 4], dtype=np.int32))
    assert h1 == hash_block(ROOT_HASH, (1, 2, 3, 4))
    assert h1 != hash_block(ROOT_HASH, [1, 2, 3, 5])
    assert h1 != hash_block(ROOT_HASH, [4, 3, 2, 1])
    h2 = hash_block(h1, [5, 6, 7, 8])
    assert h2 != hash_block(ROOT_HASH, [5, 6, 7, 8])  # the parent is part of the hash
    assert h2 != hash_block(hash_block(ROOT_HASH, [9, 2, 3, 4]), [5, 6, 7, 8])
    assert hash_block(h1, [5, 6, 7, 8], "lora-a") != h2
    assert hash_block(h1, [5, 6, 7, 8], "lora-a") != hash_block(h1, [5, 6, 7, 8], "lora-b")
    assert hash_block(h1, [5, 6, 7, 8], "lora-a") == hash_block(h1, [5, 6, 7, 8], b"lora-a")
    assert hash_block(h1, [5, 6, 7, 8], "") != h2
    # Unambiguous encoding: bytes cannot move between the token ids and the extra key.
    tail = np.array([2], dtype=np.int64).tobytes()
    assert hash_block(ROOT_HASH, [1], tail) != hash_block(ROOT_HASH, [1, 2])
    assert 0 <= h1 < 2**64


def test_hash_is_the_same_in_a_fresh_process():
    # Load allocator.py by path so the child process does not import torch.
    src = Path(__file__).resolve().parents[1] / "kvcache" / "allocator.py"
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('alloc', {str(src)!r})\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "print(m.hash_block(m.hash_block(0, [1, 2, 3]), [4, 5, 6], 'k'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == hash_block(hash_block(0, [1, 2, 3]), [4, 5, 6], "k")


@pytest.mark.parametrize("bad", [-1, 4, 100, 1.0, "0", None, True])
def test_unknown_block_ids_raise(bad):
    a = BlockAllocator(4)
    a.allocate_many(4)
    before = state(a)
    for op in (a.free, a.incref, a.ref_count, lambda b: a.register(b, 1)):
        with pytest.raises(ValueError, match="unknown block id"):
            op(bad)
    assert state(a) == before


def test_numpy_ids_are_accepted_and_stored_as_int():
    a = BlockAllocator(2)
    a.allocate_many(2)
    a.free(np.int64(1))
    b = a.allocate()
    assert b == 1 and type(b) is int


def test_double_free_and_incref_of_free_block_raise():
    a = BlockAllocator(3)
    b = a.allocate()
    a.free(b)
    with pytest.raises(ValueError, match="double free of block 0"):
        a.free(b)
    with pytest.raises(ValueError, match="not in use"):
        a.incref(b)
    with pytest.raises(ValueError, match="not in use"):
        a.incref(2)  # never allocated
    a.check_integrity({})


def test_shared_block_last_reference_freed_twice_raises():
    a = BlockAllocator(2)
    b = a.allocate()
    a.incref(b)
    a.free(b)
    assert a.ref_count(b) == 1 and a.num_used == 1
    a.free(b)
    with pytest.raises(ValueError, match="double free"):
        a.free(b)


def test_free_many_is_validated_before_freeing_anything():
    a = BlockAllocator(3)
    a.allocate_many(3)
    before = state(a)
    with pytest.raises(ValueError, match="double free of block 1"):
        a.free_many([2, 1, 1])
    with pytest.raises(ValueError, match="unknown block id"):
        a.free_many([2, 7])
    assert state(a) == before
    a.free_many([2, 1, 0])
    assert list(a._clean) == [2, 1, 0]


def test_pool_size_must_be_positive():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0)


def _corrupt_cases():
    def used_in_clean(a):
        a._clean.append(0)

    def duplicate_in_clean(a):
        a._clean.append(a._clean[0])

    def lost_block(a):
        a._clean.pop()

    def clean_and_cached(a):
        a._evictable[a._clean[0]] = None

    def cached_without_hash(a):
        b = a._clean.pop()
        a._evictable[b] = None

    def clean_with_hash(a):
        a._hash_of[a._clean[0]] = 42
        a._block_of[42] = a._clean[0]

    def maps_disagree(a):
        a._block_of[a._hash_of[1]] = 0

    def negative_ref(a):
        b = a._clean.pop()
        a._ref[b] = -1

    def ref_count_drift(a):
        a._ref[0] += 1

    return [used_in_clean, duplicate_in_clean, lost_block, clean_and_cached, cached_without_hash,
            clean_with_hash, maps_disagree, negative_ref, ref_count_drift]


@pytest.mark.parametrize("corrupt", _corrupt_cases(), ids=lambda f: f.__name__)
def test_check_integrity_catches_corruption(corrupt):
    a = BlockAllocator(6)
    a.allocate_many(4)  # 0..3 used, clean [4, 5]
    a.register(1, 11)
    a.register(2, 12)
    a.free(2)  # cached
    expected = {0: 1, 1: 1, 3: 1}
    a.check_integrity(expected)
    corrupt(a)
    with pytest.raises(IntegrityError):
        a.check_integrity(expected)


def test_check_integrity_against_table_refs():
    a = BlockAllocator(4)
    a.allocate_many(2)
    a.incref(1)
    a.check_integrity({0: 1, 1: 2})
    a.check_integrity()  # no table view: the allocator's own invariants only
    with pytest.raises(IntegrityError, match="block 1: ref count 2, tables name it 1"):
        a.check_integrity({0: 1, 1: 1})
    with pytest.raises(IntegrityError, match="block 2: ref count 0, tables name it 1"):
        a.check_integrity({0: 1, 1: 2, 2: 1})
    with pytest.raises(IntegrityError, match="unknown block ids"):
        a.check_integrity({0: 1, 1: 2, 9: 1})
