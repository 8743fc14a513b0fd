"""The nixl baseline of the migration benchmark (see bench.baselines): NVIDIA's transfer library
(UCX backend), a WRITE from an initiator agent in this process into a target agent's registered
buffer in a spawned process, when the optional `nixl` package is importable; otherwise it reports
`{"gb_per_s": None, "note": "nixl not installed"}`. It is optional (not in the project's
requirements); on a CPU-only machine `pip install --no-deps nixl nixl-cu12` installs it and UCX
runs over host memory. Timed per WRITE from `transfer` to DONE (handles are prepared untimed, as
nixl users do); any failure is reported as a note, never raised. Re-exported by bench.baselines.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time

import torch
import xxhash

NIXL_INITIATOR, NIXL_TARGET = "pdserve-bench-initiator", "pdserve-bench-target"


def _nixl_target(conn, nbytes: int) -> None:
    """The target process of the nixl baseline: registers a buffer, publishes its agent metadata
    and descriptors, then serves "digest" requests until told to stop (None)."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config

        agent = nixl_agent(NIXL_TARGET, nixl_agent_config(backends=["UCX"]))
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        agent.register_memory(dst)
        conn.send(("ready", agent.get_agent_metadata(),
                   agent.get_serialized_descs(agent.get_xfer_descs(dst))))
        agent.add_remote_agent(conn.recv())  # the initiator's metadata (for its notifications)
        while True:
            if not conn.poll(300):
                return
            msg = conn.recv()
            if msg is None:
                return
            conn.send(("digest", xxhash.xxh3_64_intdigest(dst.numpy())))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))


def nixl(nbytes: int, repeats: int = 5) -> dict:
    """{"gb_per_s": float, "verified": bool, "note"} or {"gb_per_s": None, "note": why}; never
    raises. Two processes: this one initiates WRITEs into a spawned target's registered buffer."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        return {"gb_per_s": None, "note": "nixl not installed"}
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_nixl_target, args=(child, nbytes), daemon=True)
    try:
        proc.start()
        agent = nixl_agent(NIXL_INITIATOR, nixl_agent_config(backends=["UCX"]))
        src = torch.randint(1, 256, (nbytes,), dtype=torch.uint8)
        agent.register_memory(src)
        if not conn.poll(120):
            raise RuntimeError("nixl target process did not start")
        kind, *rest = conn.recv()
        if kind != "ready":
            raise RuntimeError(f"nixl target: {rest[0]}")
        remote_meta, remote_descs = rest
        conn.send(agent.get_agent_metadata())
        remote_name = agent.add_remote_agent(remote_meta)
        remote = agent.deserialize_descs(remote_descs)
        local = agent.get_xfer_descs(src)
        times = []
        for i in range(1 + repeats):  # the first is an untimed warm-up (connection setup)
            handle = agent.initialize_xfer("WRITE", local, remote, remote_name, f"x{i}".encode())
            t0 = time.perf_counter()
            state = agent.transfer(handle)
            deadline = time.monotonic() + 60
            while state != "DONE":
                if state == "ERR" or time.monotonic() > deadline:
                    raise RuntimeError(f"nixl transfer state {state}")
                state = agent.check_xfer_state(handle)
            if i > 0:
                times.append(time.perf_counter() - t0)
            agent.release_xfer_handle(handle)
        conn.send("digest")
        if not conn.poll(120):
            raise RuntimeError("nixl target did not answer")
        kind, value = conn.recv()
        if kind != "digest":
            raise RuntimeError(f"nixl target: {value}")
        verified = value == xxhash.xxh3_64_intdigest(src.numpy())
        if not verified:
            raise RuntimeError("nixl transfer did not deliver the bytes")
        return {"gb_per_s": nbytes / statistics.median(times) / 1e9, "verified": True,
                "note": "UCX, initiator and target agents in two processes"}
    except Exception as e:  # an optional peer library: report, do not fail the benchmark
        return {"gb_per_s": None, "note": f"nixl failed: {type(e).__name__}: {e}"[:300]}
    finally:
        try:
            conn.send(None)
        except OSError:
            pass
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
