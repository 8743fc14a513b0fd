"""`python -m bench.shm_copy`: do 2 threads pay for the same-node pull path?

Reads a 256 MiB Llama-3-8B-shaped pool from its /dev/shm file through `transfer.pull.ShmSource`
in the receiver's 2 MiB chunks (each copied and hashed a window at a time), with 1 and with 2
threads, beside one torch copy of the same bytes between two touched buffers on one thread (the
`bench migrate` memcpy baseline) and a copy followed by a separate hash pass, alternating, four
rounds; prints GB/s and writes nothing.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from kvcache.storage import KVLayout
from measure.pools import make_manager
from transfer.checksum import checksum_many
from transfer.pull import ShmSource

CHUNK = 2 << 20


def main(rounds: int = 4) -> None:
    src = make_manager(KVLayout(32, 8, 128, 16, "float16"), 2050, shm=True)  # 128 KiB blocks
    n = 2048 * src.storage.layout.block_bytes
    pool = np.frombuffer(src.storage.block_bytes_view(0, 2048), dtype=np.uint8)
    pool[:] = np.random.default_rng(0).integers(1, 256, size=n, dtype=np.uint8)
    dst = np.ones(n, dtype=np.uint8)
    source = ShmSource(src.storage.shm_path.encode())
    items = [(off, [memoryview(dst[off:off + CHUNK])]) for off in range(0, n, CHUNK)]

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return n / (time.perf_counter() - t0) / 1e9

    def copy_then_hash() -> None:
        for off, _ in items:  # what the pull path did before hashing while copying
            np.copyto(dst[off:off + CHUNK], source.map[off:off + CHUNK])
        checksum_many([bufs for _, bufs in items])

    torch.set_num_threads(1)
    src_t, dst_t = torch.from_numpy(pool), torch.from_numpy(dst)
    for r in range(rounds):
        print(f"round {r}: memcpy {timed(lambda: dst_t.copy_(src_t)):.2f} GB/s, "
              f"pull+hash 1 thread {timed(lambda: source.read_many(items, 1)):.2f}, "
              f"2 threads {timed(lambda: source.read_many(items, 2)):.2f}, "
              f"copy then hash pass {timed(copy_then_hash):.2f}", flush=True)


if __name__ == "__main__":
    main()
