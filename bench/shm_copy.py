"""`python -m bench.shm_copy`: does a 2-thread copy pay for the same-node pull path?

Reads a 256 MiB Llama-3-8B-shaped pool from its /dev/shm file through `transfer.pull.ShmSource`
in the receiver's 2 MiB chunks, with 1 and with 2 copy threads, beside one memcpy of the same bytes
between two touched buffers, alternating, four rounds; prints GB/s and writes nothing.
"""

from __future__ import annotations

import time

import numpy as np

from bench.pools import make_manager
from kvcache.storage import KVLayout
from transfer.pull import ShmSource

CHUNK = 2 << 20


def main(rounds: int = 4) -> None:
    src = make_manager(KVLayout(32, 8, 128, 16, "float16"), 2050, shm=True)  # 128 KiB blocks
    n = 2048 * src.storage.layout.block_bytes
    pool = np.frombuffer(src.storage.block_bytes_view(0, 2048), dtype=np.uint8)
    pool[:] = 7
    dst = np.ones(n, dtype=np.uint8)
    source = ShmSource(src.storage.shm_path.encode())

    def pulled(threads: int) -> float:
        source.threads = threads
        t0 = time.perf_counter()
        for off in range(0, n, CHUNK):
            source.read(off, [memoryview(dst[off:off + CHUNK])])
        return n / (time.perf_counter() - t0) / 1e9

    def memcpy() -> float:
        t0 = time.perf_counter()
        np.copyto(dst, pool)
        return n / (time.perf_counter() - t0) / 1e9

    for r in range(rounds):
        print(f"round {r}: memcpy {memcpy():.2f} GB/s, pull 1 thread {pulled(1):.2f}, "
              f"2 threads {pulled(2):.2f}", flush=True)


if __name__ == "__main__":
    main()
