"""Migration time per block size for `pdserve bench blocksize`: the prompts of the mixed trace
(their lengths, with random non-zero KV in the engine model's KV layout) move from a prefill-side
pool to a decode-side pool over ZeroMQ tcp:// in this process, through the transport's public
entry points only (`ZmqSender(fingerprint, TransportConfig).migrate(...)` on the caller's thread,
`ZmqReceiver(manager, config).poll(timeout)` on a background thread that frees each import, out of
the prefix cache too, so every repeat sends everything). Both pools' free lists are shuffled
first, so a sequence's blocks are scattered as in a long-running engine (a fresh pool would hand
out one contiguous run, one frame, at any B). `measure_migrations` covers every size (equal
sizes) plus the re-blocking pairs (prefill B != decode B), and their equal-size baselines.
"""

from __future__ import annotations

import dataclasses
import queue
import random
import statistics
import threading
import time

from kvcache.table import blocks_for


def _scatter(manager, rng: random.Random) -> None:
    """Shuffle the pool's clean queue: later allocations take scattered block ids."""
    a = manager.allocator
    blocks = a.allocate_many(a.num_blocks)
    rng.shuffle(blocks)
    a.free_many(blocks)


class _Served:
    """A ZmqReceiver polled on a thread; each committed import is freed and reported on `done`."""

    def __init__(self, manager) -> None:
        from transfer.channels.zmq_receiver import ZmqReceiver
        from transfer.transport import TransportConfig

        self.manager, self.done, self.stop = manager, queue.Queue(), threading.Event()
        self.rx = ZmqReceiver(manager, TransportConfig(address="tcp://127.0.0.1:0"))
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                result = self.rx.poll(0.05)
            except Exception as e:  # noqa: BLE001 - handed to the waiting caller
                self.done.put(e)
                continue
            if result is not None:
                self.manager.free(result.seq_id, uncache=True)
                self.done.put(result)

    def wait(self, timeout: float = 60.0):
        got = self.done.get(timeout=timeout)
        if isinstance(got, Exception):
            raise got
        return got

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.rx.close()


def migrate_pair(layout, src_block: int, dst_block: int, lengths: list[int], repeats: int, seed: int) -> dict:
    """Migrate sequences of `lengths` tokens `repeats` times from a B=src_block pool to a B=dst_block
    pool (after one untimed warm-up); migration_ms is the mean per sequence of the median repeat."""
    import torch

    from measure.pools import fill_random_sequence, make_manager
    from transfer.channels.zmq_channel import ZmqSender
    from transfer.transport import TransportConfig

    rng = random.Random(seed)
    src = make_manager(dataclasses.replace(layout, block_size=src_block),
                       sum(blocks_for(n, src_block) for n in lengths) + 2, prefault=True)
    dst = make_manager(dataclasses.replace(layout, block_size=dst_block),
                       sum(blocks_for(n, dst_block) for n in lengths) + 2, prefault=True)
    _scatter(src, rng)
    _scatter(dst, rng)
    gen = torch.Generator().manual_seed(seed)
    for i, n in enumerate(lengths):
        fill_random_sequence(src, i, n, gen)
    served = _Served(dst)
    tx = ZmqSender(src.storage.layout.fingerprint(), TransportConfig(address=served.rx.address))
    try:
        tx.connect()
        tx.migrate(src, 0, "warm-up", 1)
        served.wait()
        totals = []
        for rep in range(repeats):
            total = 0.0
            for i in range(len(lengths)):
                t0 = time.perf_counter()
                tx.migrate(src, i, f"r{rep}-{i}", 1)
                total += time.perf_counter() - t0
                served.wait()
            totals.append(total)
    finally:
        tx.close()
        served.close()
    dst.check_integrity()
    return {"src_block_size": src_block, "dst_block_size": dst_block,
            "migration_ms": 1e3 * statistics.median(totals) / len(lengths),
            "blocks_sent": sum(blocks_for(n, src_block) for n in lengths),
            "payload_bytes": sum(blocks_for(n, src_block) for n in lengths) * src.storage.layout.block_bytes,
            "kv_bytes": sum(lengths) * src.storage.layout.block_bytes // src_block, "repeats": repeats}


def measure_migrations(layout, sizes, pairs, lengths: list[int], repeats: int, seed: int, log) -> dict:
    """(src, dst) -> migrate_pair result, for (B, B) of every size, every pair, and each pair's
    equal-size baselines."""
    want = [(b, b) for b in sizes]
    for s, d in pairs:
        want += [(s, d), (s, s), (d, d)]
    out: dict[tuple[int, int], dict] = {}
    for k, (s, d) in enumerate(dict.fromkeys(want)):
        try:
            out[(s, d)] = migrate_pair(layout, s, d, lengths, repeats, seed)
        except Exception as e:  # noqa: BLE001 - said and recorded, never silently skipped
            out[(s, d)] = {"src_block_size": s, "dst_block_size": d, "migration_ms": None, "error": repr(e)}
            log(f"migrate B {s} -> {d} FAILED: {e!r}")
            continue
        log(f"migrate [{k + 1}/{len(dict.fromkeys(want))}] B {s} -> {d}: {out[(s, d)]['migration_ms']:.2f} "
            f"ms per sequence ({len(lengths)} sequences, {repeats} repeats)")
    return out
