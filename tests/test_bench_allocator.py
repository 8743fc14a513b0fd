"""Allocator micro-benchmark smoke test: tiny pools, JSON structure, and (through counting subclasses
of the real allocator and manager) proof that the reported operations really ran and leaked nothing.
No timing assertions."""

import json

import pytest

from bench.allocator import OPS, BenchConfig, run_bench
from kvcache.allocator import BlockAllocator
from kvcache.manager import KVCacheManager
from pdserve_cli.main import main


class CountingAllocator(BlockAllocator):
    instances: list = []

    def __init__(self, num_blocks):
        super().__init__(num_blocks)
        self.calls = {"allocate": 0, "free": 0, "incref": 0}
        CountingAllocator.instances.append(self)

    def allocate(self):
        block = super().allocate()
        self.calls["allocate"] += block is not None
        return block

    def free(self, block, uncache=False):
        super().free(block, uncache)
        self.calls["free"] += 1

    def incref(self, block):
        super().incref(block)
        self.calls["incref"] += 1


class CountingManager(KVCacheManager):
    instances: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = {"fork": 0, "append": 0}
        CountingManager.instances.append(self)

    def fork(self, parent_id, child_id):
        super().fork(parent_id, child_id)
        self.calls["fork"] += 1

    def append(self, seq_id, token_ids):
        ok = super().append(seq_id, token_ids)
        self.calls["append"] += ok
        return ok


def test_bench_counts_are_real_and_nothing_leaks():
    CountingAllocator.instances.clear()
    CountingManager.instances.clear()
    cfg = BenchConfig(sizes=(64, 300), ops=700, repeats=2, block_size=4, fork_blocks=3)
    lines = []
    record = run_bench(cfg, progress=lines.append, allocator_cls=CountingAllocator,
                       manager_cls=CountingManager)
    assert set(record) == {"config", "python", "results", "scaling"}
    assert [r["pool_blocks"] for r in record["results"]] == [64, 300]
    assert set(record["scaling"]) == set(OPS)
    assert len(lines) == 4  # one start and one result line per pool
    json.dumps(record)  # serialisable as is
    for row, alloc, mgr in zip(record["results"], CountingAllocator.instances, CountingManager.instances):
        assert alloc.num_blocks == row["pool_blocks"] and mgr.allocator is alloc
        for op in OPS:
            stats = row["ops"][op]
            assert stats["count"] == 700 and stats["seconds"] > 0
            assert stats["ops_per_s"] == pytest.approx(700 / stats["seconds"])
        reps = cfg.repeats
        assert mgr.calls == {"fork": 700 * reps, "append": 700 * reps}
        assert alloc.calls["incref"] == 700 * reps * cfg.fork_blocks  # each fork shares every block
        # timed allocates, plus one block per block_size appends, plus untimed setup allocations
        assert alloc.calls["allocate"] >= 700 * reps + 700 * reps // cfg.block_size
        # every reference taken (allocate or incref) was dropped again, and the pool is whole
        assert alloc.calls["free"] == alloc.calls["allocate"] + alloc.calls["incref"]
        assert alloc.num_free == alloc.num_blocks and not mgr.tables
        alloc.check_integrity(expected_refs={})


def test_bench_rejects_a_pool_too_small():
    with pytest.raises(ValueError, match="too small"):
        BenchConfig(sizes=(10,), ops=10)


def test_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "allocator", "--sizes", "64,128", "--ops", "200", "--repeats", "1",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["pool_blocks"] for r in doc["results"]] == [64, 128]
    assert all(r["ops"][op]["count"] == 200 for r in doc["results"] for op in OPS)
    captured = capsys.readouterr()
    assert "pool_blocks" in captured.out and "[2/2]" in captured.err
