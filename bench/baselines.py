"""Baselines the migration benchmark measures in the same run, over the same number of bytes:

- memcpy: one in-process, single-threaded torch copy (the ceiling for any copy-based path);
- raw_tcp: a plain loopback TCP stream into a separate process's pre-touched buffer (the raw
  socket limit the ZeroMQ transport is compared against);
- pickle_pipe: the naive approach, a numpy array pickled over a multiprocessing pipe to a
  spawned process. Pickle appears ONLY here, as the thing being compared against;
- nixl: NVIDIA's transfer library (UCX backend) between two agents in this process, when the
  optional `nixl` package is importable; otherwise reported as not installed. (It is not
  installed on the build machines, so that path has not been run here.)
Each returns GB/s (1e9 bytes per second) of the median of `repeats` timed runs. `Baselines`
measures all of them (and the xxh3 checksum speed) once per payload size for `bench.migrate`.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import statistics
import time

import numpy as np
import torch

from transfer.checksum import measure_gb_per_s

PICKLE_MAX_BYTES = 1 << 30  # the pickle baseline holds ~4 copies of the payload at once


def _median_gbps(nbytes: int, times: list[float]) -> float:
    return nbytes / statistics.median(times) / 1e9


def memcpy(nbytes: int, repeats: int = 5) -> float:
    """One torch copy on one thread (every path measured here copies on one thread too)."""
    src = torch.randint(1, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dst.copy_(src)  # touch both
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return _median_gbps(nbytes, times)


def raw_tcp(payload: memoryview, open_sink, repeats: int = 5) -> float:
    """open_sink(nbytes) -> port of a one-shot sink in another process (see bench.migrate_peer)."""
    times = []
    for _ in range(repeats):
        port = open_sink(payload.nbytes)
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            t0 = time.perf_counter()
            s.sendall(payload)
            if s.recv(1) != b"k":
                raise RuntimeError("raw tcp sink did not confirm")
            times.append(time.perf_counter() - t0)
    return _median_gbps(payload.nbytes, times)


def _pickle_sink(conn) -> None:
    while True:
        if not conn.poll(120):
            return
        obj = conn.recv()  # unpickles (the cost being measured)
        if obj is None:
            return
        conn.send(int(obj.nbytes))


class PicklePipe:
    """A spawned child at the other end of a multiprocessing pipe, kept for several sizes."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_pickle_sink, args=(child,), daemon=True)
        self.proc.start()
        self.conn.send(np.ones(8, dtype=np.uint8))  # wait until the child is up
        if not self.conn.poll(120):
            raise RuntimeError("pickle_pipe child did not start")
        self.conn.recv()

    def measure(self, array: np.ndarray, repeats: int = 3) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.conn.send(array)
            if not self.conn.poll(300):
                raise RuntimeError("pickle_pipe child did not answer")
            if self.conn.recv() != array.nbytes:
                raise RuntimeError("pickle_pipe child received the wrong size")
            times.append(time.perf_counter() - t0)
        return _median_gbps(array.nbytes, times)

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()


def nixl(nbytes: int, repeats: int = 5) -> dict:
    """{"gb_per_s": float} or {"gb_per_s": None, "note": why} (never raises)."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        return {"gb_per_s": None, "note": "nixl not installed"}
    try:
        cfg = nixl_agent_config(backends=["UCX"])
        a, b = nixl_agent("pdserve-bench-a", cfg), nixl_agent("pdserve-bench-b", cfg)
        src = torch.randint(1, 256, (nbytes,), dtype=torch.uint8)
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        a.register_memory(src)
        b.register_memory(dst)
        a.add_remote_agent(b.get_agent_metadata())
        local, remote = a.get_xfer_descs(src), b.get_xfer_descs(dst)
        times = []
        for i in range(repeats):
            handle = a.initialize_xfer("WRITE", local, remote, "pdserve-bench-b", f"x{i}".encode())
            t0 = time.perf_counter()
            state = a.transfer(handle)
            deadline = time.monotonic() + 60
            while state != "DONE":
                if state == "ERR" or time.monotonic() > deadline:
                    raise RuntimeError(f"nixl transfer state {state}")
                state = a.check_xfer_state(handle)
            times.append(time.perf_counter() - t0)
            a.release_xfer_handle(handle)
        if not torch.equal(src, dst):
            raise RuntimeError("nixl transfer did not deliver the bytes")
        return {"gb_per_s": _median_gbps(nbytes, times), "note": "UCX, two agents in one process"}
    except Exception as e:  # an optional peer library: report, do not fail the benchmark
        return {"gb_per_s": None, "note": f"nixl failed: {type(e).__name__}: {e}"[:300]}


class Baselines:
    """Measures every baseline once per payload size, right after the transports' points at that
    size, so both see the same machine conditions. peer: the benchmark's receiving process (it
    opens the raw_tcp sinks); rows: what was measured so far, in the report's format."""

    def __init__(self, peer, repeats: int, log):
        self.peer, self.repeats, self.log, self.rows, self.sizes = peer, repeats, log, [], set()
        self.rows.append({"name": "xxh3_checksum", "bytes": 64 << 20, "gb_per_s": measure_gb_per_s()})
        self.pickle = PicklePipe()

    def measure(self, n: int) -> None:
        if n in self.sizes:
            return
        self.sizes.add(n)
        reps = max(3, self.repeats)
        payload = np.random.default_rng(n).integers(1, 256, size=n, dtype=np.uint8)
        rows = [{"name": "memcpy", "bytes": n, "gb_per_s": memcpy(n, reps)},
                {"name": "raw_tcp", "bytes": n, "gb_per_s": raw_tcp(
                    memoryview(payload), lambda k: self.peer.call(cmd="raw_tcp", nbytes=k)["port"], reps)}]
        if n <= PICKLE_MAX_BYTES:
            rows.append({"name": "pickle_pipe", "bytes": n, "gb_per_s": self.pickle.measure(payload, 3)})
        else:
            rows.append({"name": "pickle_pipe", "bytes": n, "gb_per_s": None, "note": "skipped above 1 GiB"})
        rows.append({"name": "nixl", "bytes": n, **nixl(n, reps)})
        self.rows += rows
        self.log(f"baselines at {n / 2**20:.2f} MiB: " + ", ".join(
            f"{b['name']} {b['gb_per_s']:.2f} GB/s" if b["gb_per_s"] else f"{b['name']} n/a" for b in rows))

    def close(self) -> None:
        self.pickle.close()
