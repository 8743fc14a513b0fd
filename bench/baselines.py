"""Baselines the migration benchmark measures in the same run, over the same number of bytes.
Each is made as well as its kind allows, so a ratio against it means something:

- memcpy: one in-process, single-threaded torch copy (the ceiling for any copy-based path);
- raw_tcp: a well-made loopback TCP stream between two processes: the sender `sendall`s 1 MiB
  memoryview slices of the payload, the receiver (the benchmark's peer process,
  `measure.migrate_peer`) `recv_into`s a preallocated, pre-touched buffer in 1 MiB pieces and
  confirms each transfer with one byte. One connection per payload size, reused by the warm-up
  and the timed repeats (connection setup is not timed); after the repeats the receiver's buffer
  is checked against the payload (xxh3), untimed;
- raw_tcp_xxh3: the same stream doing the integrity work every pdserve path does: the sender
  hashes each 1 MiB piece (xxh3) before sending it, the receiver each piece after it lands. The
  ratio against it is what the protocol costs beyond moving and checking bytes
  (`python -m bench.tcp_hash` splits the checksum's cost by side);
- ray_put_get: `ray.put` of the payload array in the driver, then an actor method that `ray.get`s
  it and copies it into its preallocated, pre-touched buffer; timed from before the put until the
  method's reply. Measured only while Ray is running (the benchmark starts it for the `ray`
  transport); the actor's buffer is checked against the payload afterwards, untimed;
- pickle_pipe: the naive approach, a numpy array pickled over a multiprocessing pipe to a
  spawned process. Pickle appears ONLY here, as the thing being compared against;
- nixl: NVIDIA's transfer library (UCX backend), a WRITE from an initiator agent in this process
  into a target agent's registered buffer in a spawned process (two processes, as real users run
  it), when the optional `nixl` package is importable; otherwise reported as
  `{"gb_per_s": None, "note": "nixl not installed"}`; any failure in it is reported as a note,
  never raised. Its processes and agents are made once per benchmark and reused for every size.
  It lives in bench.baselines_nixl and is re-exported here.
- nixl_xxh3: the same WRITE with the integrity work every pdserve path does, timed: xxh3 of the
  payload before it on the initiator and after it on the target (the ratio against it is what
  the nixl channel costs beyond moving and checking bytes).
- pinned_d2h / pinned_h2d: with device pools (`bench migrate --device cuda`), one copy of the
  payload between device memory and a pinned host buffer each way: every host-staged path
  crosses the bus twice, so these bound a device-to-device migration through the host.
Each returns GB/s (1e9 bytes per second) of the median of `repeats` timed runs. `Baselines`
measures all of them (and the xxh3 checksum speed) once per payload size for `measure.migrate`.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import statistics
import time

import numpy as np
import torch
import xxhash

from bench.baselines_nixl import NIXL_INITIATOR as NIXL_INITIATOR
from bench.baselines_nixl import NIXL_TARGET as NIXL_TARGET
from bench.baselines_nixl import NixlBaseline
from bench.baselines_nixl import nixl as nixl
from transfer.checksum import measure_gb_per_s

PICKLE_MAX_BYTES = 1 << 30  # the pickle baseline holds ~4 copies of the payload at once
PIECE = 1 << 20  # raw_tcp: bytes per sendall / recv_into call


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


def raw_tcp(payload: memoryview, open_sink, repeats: int = 5, warmup: int = 1,
            digest=None, hashed: bool = False) -> dict:
    """A well-made socket transfer into another process; {"gb_per_s", "verified"}.

    open_sink(nbytes) -> port of a sink in another process that, per transfer, receives nbytes
    into its pre-touched buffer and replies one byte (see `measure.migrate_peer.raw_tcp_sink`); the
    connection is opened once and reused for the warm-up and every timed repeat.
    digest(port) -> xxh3-64 of the sink's buffer (optional; checked after the repeats, untimed).
    hashed: xxh3 each piece before sending it (the sink must hash on its side too: raw_tcp_xxh3)."""
    payload = payload.cast("B")
    n = payload.nbytes
    port = open_sink(n)
    times = []
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for r in range(warmup + repeats):
            t0 = time.perf_counter()
            for off in range(0, n, PIECE):
                if hashed:
                    xxhash.xxh3_64_intdigest(payload[off:off + PIECE])
                s.sendall(payload[off:off + PIECE])
            if s.recv(1) != b"k":
                raise RuntimeError("raw tcp sink did not confirm")
            if r >= warmup:
                times.append(time.perf_counter() - t0)
    verified = None if digest is None else digest(port) == xxhash.xxh3_64_intdigest(payload)
    return {"gb_per_s": _median_gbps(n, times), "verified": verified}


class RaySink:
    """The receiving actor of the ray_put_get baseline: `ray.remote(RaySink).remote()`."""

    def __init__(self) -> None:
        self.buf = np.empty(0, dtype=np.uint8)
        self.n = 0

    def prepare(self, nbytes: int) -> int:
        if self.buf.nbytes < nbytes:
            self.buf = np.ones(nbytes, dtype=np.uint8)  # pre-touched: no page faults when timed
        return int(self.buf.nbytes)

    def receive(self, refs: list) -> int:
        """refs: [ObjectRef of the payload] (in a list, so Ray hands over the ref, not the value)."""
        import ray

        arr = ray.get(refs[0])
        self.n = int(arr.nbytes)
        self.buf[:self.n] = arr
        return self.n

    def digest(self) -> int:
        return xxhash.xxh3_64_intdigest(self.buf[:self.n])


def ray_put_get(array: np.ndarray, actor, repeats: int = 5, warmup: int = 1) -> dict:
    """ray.put in this process, ray.get + copy into a preallocated buffer in `actor` (a RaySink)."""
    import ray

    ray.get(actor.prepare.remote(array.nbytes), timeout=300)
    times = []
    for r in range(warmup + repeats):
        t0 = time.perf_counter()
        ref = ray.put(array)
        got = ray.get(actor.receive.remote([ref]), timeout=300)
        dt = time.perf_counter() - t0
        del ref
        if got != array.nbytes:
            raise RuntimeError(f"ray_put_get actor received {got} bytes, not {array.nbytes}")
        if r >= warmup:
            times.append(dt)
    verified = ray.get(actor.digest.remote(), timeout=300) == xxhash.xxh3_64_intdigest(array)
    return {"gb_per_s": _median_gbps(array.nbytes, times), "verified": bool(verified)}


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


def pinned_copy(nbytes: int, device: str, to_device: bool, repeats: int = 5) -> float:
    """One host<->device copy of `nbytes` through a pinned host buffer, synchronized."""
    host = torch.randint(1, 256, (nbytes,), dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src, dst = (host, dev) if to_device else (dev, host)
    dst.copy_(src)  # touch both
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return _median_gbps(nbytes, times)


class Baselines:
    """Measures every baseline once per payload size, right after the transports' points at that
    size, so both see the same machine conditions. peer: the benchmark's receiving process (it
    opens the raw_tcp sinks); rows: what was measured so far, in the report's format; device:
    the pools' device (not 'cpu': the pinned copies are measured too)."""

    def __init__(self, peer, repeats: int, log, device: str = "cpu"):
        self.peer, self.repeats, self.log, self.rows, self.sizes = peer, repeats, log, [], set()
        self.device = device
        self.rows.append({"name": "xxh3_checksum", "bytes": 64 << 20, "gb_per_s": measure_gb_per_s()})
        self.pickle = PicklePipe()
        self.nixl = NixlBaseline()  # started at the first size, kept for the others
        self.ray_sink = None

    def _ray_row(self, payload: np.ndarray, reps: int) -> dict:
        row = {"name": "ray_put_get", "bytes": payload.nbytes}
        try:
            import ray
        except ImportError:
            return {**row, "gb_per_s": None, "note": "ray not installed"}
        if not ray.is_initialized():
            return {**row, "gb_per_s": None, "note": "ray not running (the ray transport was not selected)"}
        if self.ray_sink is None:
            self.ray_sink = ray.remote(num_cpus=0.5)(RaySink).remote()
        return {**row, **ray_put_get(payload, self.ray_sink, reps)}

    def measure(self, n: int) -> None:
        if n in self.sizes:
            return
        self.sizes.add(n)
        reps = max(3, self.repeats)
        payload = np.random.default_rng(n).integers(1, 256, size=n, dtype=np.uint8)

        def tcp_row(hashed: bool) -> dict:
            def sink(k: int) -> int:
                return self.peer.call(cmd="raw_tcp", nbytes=k, hashed=hashed)["port"]

            return raw_tcp(memoryview(payload), sink, reps, hashed=hashed,
                           digest=lambda port: self.peer.call(cmd="raw_tcp_digest", port=port)["digest"])

        tcp = {hashed: tcp_row(hashed) for hashed in (False, True)}
        rows = [{"name": "memcpy", "bytes": n, "gb_per_s": memcpy(n, reps)},
                {"name": "raw_tcp", "bytes": n, **tcp[False]},
                {"name": "raw_tcp_xxh3", "bytes": n, **tcp[True]},
                self._ray_row(payload, reps)]
        if n <= PICKLE_MAX_BYTES:
            rows.append({"name": "pickle_pipe", "bytes": n, "gb_per_s": self.pickle.measure(payload, 3)})
        else:
            rows.append({"name": "pickle_pipe", "bytes": n, "gb_per_s": None, "note": "skipped above 1 GiB"})
        rows.append({"name": "nixl", "bytes": n, **self.nixl.measure(n, reps)})
        rows.append({"name": "nixl_xxh3", "bytes": n, **self.nixl.measure(n, reps, hashed=True)})
        if self.device != "cpu":
            rows += [{"name": f"pinned_{way}", "bytes": n,
                      "gb_per_s": pinned_copy(n, self.device, way == "h2d", reps)} for way in ("d2h", "h2d")]
        self.rows += rows
        self.log(f"baselines at {n / 2**20:.2f} MiB: " + ", ".join(
            f"{b['name']} {b['gb_per_s']:.2f} GB/s" if b["gb_per_s"] else f"{b['name']} n/a" for b in rows))

    def close(self) -> None:
        self.pickle.close()
        self.nixl.close()
        if self.ray_sink is not None:
            import ray

            ray.kill(self.ray_sink)
            self.ray_sink = None
