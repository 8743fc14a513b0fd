"""Allocator micro-benchmark: allocate / free / fork / append operations per second against pool size.

For each pool size the pool is first half filled (untimed) so every phase runs against a partly
used pool, then four phases are timed, best of `repeats`:
- allocate: `BlockAllocator.allocate()` one block at a time (in rounds that fit the free pool);
- free: `BlockAllocator.free()` of those blocks, tail first;
- fork: `KVCacheManager.fork()` of a `fork_blocks`-block sequence (one op = one whole fork);
- append: `KVCacheManager.append()` of one token to one of several growing sequences (a new block
  every `block_size` appends, as in decoding).
No storage tensor is involved: this measures the bookkeeping only. The claim under test is that
cost per operation does not grow with pool size; `scaling` reports ns/op at the largest pool over
ns/op at the smallest. After each pool the allocator's integrity is checked and every block must
be back on the free list, so the counted operations provably happened and leaked nothing.
"""

from __future__ import annotations

import gc
import platform
import time
from dataclasses import asdict, dataclass

from kvcache.allocator import BlockAllocator
from kvcache.manager import KVCacheManager

OPS = ("allocate", "free", "fork", "append")
SEQ_BLOCKS = 16  # blocks each appending sequence grows to
MAX_SEQS = 16  # sequences appended to round-robin
FORK_ROUND = 1024  # children forked before they are freed (untimed)


@dataclass(frozen=True)
class BenchConfig:
    """What the benchmark runs.

    sizes: pool sizes in blocks.
    ops: timed operations of each kind per pool size (per repeat).
    repeats: each phase runs this many times; the fastest run is reported.
    block_size: tokens per block for the manager phases (fork, append).
    fork_blocks: blocks of the sequence that is forked.
    occupancy: fraction of the pool held (untimed) while the phases run.
    """

    sizes: tuple[int, ...] = (1_000, 10_000, 100_000, 1_000_000)
    ops: int = 200_000
    repeats: int = 3
    block_size: int = 16
    fork_blocks: int = 8
    occupancy: float = 0.5

    def __post_init__(self):
        if not self.sizes:
            raise ValueError("sizes: need at least one pool size")
        if self.ops < 1 or self.repeats < 1 or self.block_size < 1 or self.fork_blocks < 1:
            raise ValueError("ops, repeats, block_size and fork_blocks must all be >= 1")
        if not 0.0 <= self.occupancy < 1.0:
            raise ValueError(f"occupancy must be in [0, 1), got {self.occupancy}")
        for n in self.sizes:
            if n < self.min_pool():
                raise ValueError(f"sizes: pool of {n} blocks is too small; need >= {self.min_pool()}")

    def min_pool(self) -> int:
        """Smallest pool whose unheld part fits the forked sequence and one appending sequence."""
        return int((self.fork_blocks + SEQ_BLOCKS) / (1.0 - self.occupancy)) + 2


class _Timer:
    """Accumulates nanoseconds of the timed regions, with the garbage collector paused."""

    def __init__(self):
        self.ns = 0

    def __enter__(self):
        gc.disable()
        self._t0 = time.perf_counter_ns()
        return self

    def __exit__(self, *exc):
        self.ns += time.perf_counter_ns() - self._t0
        gc.enable()
        return False


def _phase_allocate_free(alloc, ops: int) -> tuple[int, int]:
    """ns spent in `ops` allocate calls and in freeing them again (rounds that fit the free pool)."""
    t_alloc, t_free, done = _Timer(), _Timer(), 0
    a, f = alloc.allocate, alloc.free
    while done < ops:
        m = min(ops - done, alloc.num_available)
        with t_alloc:
            blocks = [a() for _ in range(m)]
        if None in blocks:
            raise RuntimeError("allocate returned None with blocks available")
        blocks.reverse()
        with t_free:
            for b in blocks:
                f(b)
        done += m
    return t_alloc.ns, t_free.ns


def _phase_fork(mgr, cfg: BenchConfig, ops: int) -> int:
    t, done = _Timer(), 0
    if mgr.allocate("parent", [1] * (cfg.fork_blocks * cfg.block_size)) is None:
        raise RuntimeError("pool too small for the forked sequence")
    fork = mgr.fork
    while done < ops:
        kids = [("kid", i) for i in range(min(FORK_ROUND, ops - done))]
        with t:
            for kid in kids:
                fork("parent", kid)
        for kid in kids:
            mgr.free(kid)
        done += len(kids)
    mgr.free("parent")
    return t.ns


def _phase_append(mgr, cfg: BenchConfig, ops: int) -> int:
    t, done = _Timer(), 0
    nseq = max(1, min(MAX_SEQS, mgr.allocator.num_available // SEQ_BLOCKS))
    per_round = nseq * (SEQ_BLOCKS * cfg.block_size - 1)
    append, tok = mgr.append, [1]
    while done < ops:
        seqs = [("seq", i) for i in range(nseq)]
        for s in seqs:
            if mgr.allocate(s, [1]) is None:
                raise RuntimeError("pool too small for the appending sequences")
        order = [seqs[k % nseq] for k in range(min(per_round, ops - done))]
        with t:
            for s in order:
                if not append(s, tok):
                    raise RuntimeError("append ran out of blocks")
        for s in reversed(seqs):
            mgr.free(s)
        done += len(order)
    return t.ns


def bench_pool(n: int, cfg: BenchConfig, allocator_cls=BlockAllocator, manager_cls=KVCacheManager) -> dict:
    """Best-of-repeats timings of every op on one pool of n blocks; verifies nothing leaked."""
    alloc = allocator_cls(n)
    mgr = manager_cls(alloc, cfg.block_size, storage=None, enable_prefix_caching=False)
    held = alloc.allocate_many(int(n * cfg.occupancy))
    best = {op: None for op in OPS}
    for _ in range(cfg.repeats):
        ns_alloc, ns_free = _phase_allocate_free(alloc, cfg.ops)
        timings = {"allocate": ns_alloc, "free": ns_free, "fork": _phase_fork(mgr, cfg, cfg.ops),
                   "append": _phase_append(mgr, cfg, cfg.ops)}
        for op, ns in timings.items():
            best[op] = ns if best[op] is None else min(best[op], ns)
    if mgr.tables:
        raise RuntimeError(f"benchmark left {len(mgr.tables)} sequences behind")
    alloc.free_many(held[::-1])
    alloc.check_integrity(expected_refs={})
    if alloc.num_free != n:
        raise RuntimeError(f"pool of {n}: only {alloc.num_free} blocks free after the benchmark")
    return {"pool_blocks": n, "ops": {
        op: {"count": cfg.ops, "seconds": ns / 1e9, "ops_per_s": cfg.ops / (ns / 1e9) if ns else float("inf"),
             "ns_per_op": ns / cfg.ops} for op, ns in best.items()}}


def run_bench(cfg: BenchConfig, progress=print, allocator_cls=BlockAllocator,
              manager_cls=KVCacheManager) -> dict:
    """Every pool size in turn; `progress(line)` gets one line per pool. Returns the JSON record."""
    results = []
    for i, n in enumerate(cfg.sizes):
        progress(f"[{i + 1}/{len(cfg.sizes)}] pool of {n} blocks: {cfg.ops} ops x {len(OPS)} kinds "
                 f"x {cfg.repeats} repeats ...")
        row = bench_pool(n, cfg, allocator_cls, manager_cls)
        results.append(row)
        progress("    " + "  ".join(f"{op} {row['ops'][op]['ns_per_op']:.0f} ns/op" for op in OPS))
    first, last = results[0]["ops"], results[-1]["ops"]
    return {
        "config": {**asdict(cfg), "sizes": list(cfg.sizes), "seq_blocks": SEQ_BLOCKS},
        "python": platform.python_version(),
        "results": results,
        "scaling": {op: last[op]["ns_per_op"] / first[op]["ns_per_op"] for op in OPS},
    }


def format_results(record: dict) -> str:
    """Table: one row per pool, ops per second (millions) and ns per op for each kind."""
    head = f"{'pool_blocks':>11}" + "".join(f"  {op + ' Mop/s (ns)':>22}" for op in OPS)
    lines = [head]
    for row in record["results"]:
        cells = "".join(f"  {row['ops'][op]['ops_per_s'] / 1e6:>12.2f} ({row['ops'][op]['ns_per_op']:>6.0f})"
                        for op in OPS)
        lines.append(f"{row['pool_blocks']:>11}" + cells)
    sizes = record["config"]["sizes"]
    lines.append(f"ns/op at {sizes[-1]} blocks / ns/op at {sizes[0]} blocks: "
                 + ", ".join(f"{op} x{record['scaling'][op]:.2f}" for op in OPS))
    return "\n".join(lines)
