"""Pool -> pool KV migration, end to end, measured: `pdserve bench migrate` reports it against
baselines, and `pdserve profile` fits the planner's migration cost to it.

Each point fills a sender pool with random non-zero KV for one sequence, then per repeat runs
export -> wire -> import into a receiver pool that lives in another process (a spawned
`measure.migrate_peer` for ZeroMQ control, a `measure.ray_receiver.PoolReceiver` actor for Ray; its rows
and endpoints are in `measure.migrate_endpoints`; both pools
are built the same way: prefix caching on, prefaulted), and checks that the receiver's KV digest
equals the sender's. Reported per point: p50/p99 latency, GB/s at p50, the export / wire / import
split (export: building manifest and frames; import: the receiver's validate+reserve and commit
phases, or the whole actor call for Ray; wire: the rest, which includes the overlapped chunk
copies and checksums), the manifest's size against the payload, frames and chunks.

Every timed migration is also recorded in the report's `timeline` (start time from the first
migration, the sender's export and wire spans, the receiver's phase timings from the Ack), which
`bench.migrate_trace` turns into a Chrome trace (`--trace`).

Baselines (memcpy, a well-made raw_tcp socket between two processes, ray_put_get, pickle_pipe,
nixl, and the xxh3 checksum speed; `bench.baselines`, handed in by `pdserve bench migrate` as
run_bench's `baselines`) are measured in the same run over the same
payload sizes, each size right after its transfers (same machine load); ray_put_get reuses the Ray
instance started for the `ray` transport. `bench.migrate_report` summarises (ratios against the
baselines at the largest size, the fixed overhead as the intercept of a latency-vs-bytes fit over
the small points) and plots it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvcache.manager import blocks_for
from kvcache.storage import KVLayout
from measure.migrate_endpoints import TRANSPORTS, Receivers, _actors
from measure.migrate_peer import PeerProcess
from measure.pools import fill_random_sequence, kv_digest, make_manager, parse_kv_shape
from transfer.export import export_sequence
from transfer.wire import DATA
from transfer.wire_codec import encode


@dataclass(frozen=True)
class BenchConfig:
    """What to measure. kv_shapes: presets or 'L,H,D,dtype'; tokens: sequence lengths;
    repeats: timed transfers per point (after `warmup` untimed ones); chunk_bytes: wire chunk;
    inline_bytes: the ZeroMQ senders' TransportConfig.inline_bytes (None: its default).
    small_repeats / small_warmup: the least repeats and warm-ups for payloads up to 1 MiB, which
    take milliseconds (with 4 repeats their p50 is one sample of the machine's noise).
    device: where both pools live ('cuda': the ZeroMQ transports stage through pinned buffers;
    the Ray transports are host-pool only here). secret: key the ZeroMQ senders and receiver with
    it, as in a `pdserve up` cluster ('': unkeyed)."""

    kv_shapes: tuple[str, ...] = ("tiny", "llama3-8b")
    tokens: tuple[int, ...] = (256, 1024, 4096, 16384)
    block_sizes: tuple[int, ...] = (16,)
    transports: tuple[str, ...] = TRANSPORTS
    repeats: int = 5
    warmup: int = 2
    chunk_bytes: int = 2 << 20
    baselines: bool = True  # measure the baselines too (run_bench's `baselines` makes them)
    inline_bytes: int | None = None
    small_repeats: int = 30
    small_warmup: int = 10
    device: str = "cpu"
    secret: str = ""  # the cluster secret of the ZeroMQ endpoints (CURVE control socket, signed hello)


QUICK = BenchConfig(tokens=(256, 1024, 2048), repeats=4, warmup=2)


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def _measure(cfg: BenchConfig, recv: Receivers, transport: str, src, digest: int, tag: str,
             timeline: list | None = None, origin: float = 0.0) -> dict:
    """One point; appends each timed migration's spans to `timeline` (times from `origin`).
    Payloads up to 1 MiB get at least cfg.small_warmup warm-ups and cfg.small_repeats repeats."""
    sender = recv.senders[transport]
    ecfg = sender.export_config(src.storage)  # as `SenderSession.migrate` exports on this channel
    mode = ecfg.checksum_mode
    lat, exp, imp, verified, manifest_bytes, ex = [], [], [], True, 0, None
    t = src.table("s")
    small = len(t.blocks) * src.storage.layout.block_bytes <= 1 << 20
    warmup, repeats = cfg.warmup, cfg.repeats
    if small:
        warmup, repeats = max(warmup, cfg.small_warmup), max(repeats, cfg.small_repeats)
    for r in range(warmup + repeats):
        rid = f"{tag}-{r}"
        t0 = time.perf_counter()
        ex = export_sequence(src, "s", rid, 1, config=ecfg)
        t1 = time.perf_counter()
        ack = sender.send(ex)
        t2 = time.perf_counter()
        got, _ = recv.finish(transport, rid)
        verified &= got == digest
        manifest_bytes = len(encode(ex.manifest))
        if r >= warmup:
            lat.append(t2 - t0)
            exp.append(t1 - t0)
            tm = ack.timings
            imp.append((tm.get("receive_ms") or tm.get("prepare_ms", 0) + tm.get("commit_ms", 0)) / 1e3)
            if timeline is not None:
                timeline.append({"transport": transport, "request_id": rid, "repeat": r - warmup,
                                 "bytes": ex.manifest.payload_bytes, "start_ms": (t0 - origin) * 1e3,
                                 "export_ms": (t1 - t0) * 1e3, "wire_ms": (t2 - t1) * 1e3,
                                 "verified": got == digest, "receiver_ms": dict(tm)})
    m = ex.manifest
    nbytes = m.payload_bytes
    p50 = _pct(lat, 50)
    headers = m.num_chunks * (DATA.size + 2) if mode == "inline" else 0
    return {
        "latency_ms_p50": p50 * 1e3, "latency_ms_p99": _pct(lat, 99) * 1e3, "gb_per_s": nbytes / p50 / 1e9,
        "verified": bool(verified), "bytes": nbytes, "export_ms_p50": _pct(exp, 50) * 1e3,
        "import_ms_p50": _pct(imp, 50) * 1e3,
        "wire_ms_p50": max(0.0, (p50 - _pct(exp, 50) - _pct(imp, 50)) * 1e3),
        "manifest_bytes": manifest_bytes, "manifest_ratio": manifest_bytes / nbytes,
        "control_bytes": manifest_bytes + headers, "frames": len(m.frames), "chunks": m.num_chunks,
        "blocks": len(m.block_tokens), "checksum_mode": mode, "repeats": repeats,
    }


def _run_layout(cfg: BenchConfig, peer, shape_name: str, layout_args: tuple, gen, progress,
                store: int, base, timeline: list | None = None, origin: float = 0.0) -> list[dict]:
    """Every (tokens, transport) point of one KV layout; receivers are set up once for it."""
    B, rows = layout_args[3], []
    num_blocks = blocks_for(max(cfg.tokens), B) + 2
    recv = Receivers(peer, layout_args, num_blocks, cfg.transports, cfg.chunk_bytes, store, cfg.inline_bytes,
                      cfg.device, cfg.secret)
    try:
        for T in cfg.tokens:
            # A fresh sender pool per point: its blocks are contiguous, so the payload is one frame
            # (the receiver's pool is reused across points and fragments as a real one does). In
            # /dev/shm, as a Ray prefill worker's pool is (the zmq paths read it the same way).
            src = make_manager(KVLayout(*layout_args), blocks_for(T, B) + 2, device=cfg.device,
                               shm=cfg.device == "cpu")
            fill_random_sequence(src, "s", T, gen)
            digest = kv_digest(src, "s")
            for transport in cfg.transports:
                recv.use(transport, src)
                row = {"transport": transport, "kv_shape": shape_name, "tokens": T, "block_size": B}
                spans: list = []
                row.update(_measure(cfg, recv, transport, src, digest, f"{transport}-{shape_name}-{B}-{T}",
                                    spans, origin))
                if timeline is not None:
                    timeline += [{"kv_shape": shape_name, "tokens": T, "block_size": B, **m} for m in spans]
                rows.append(row)
                progress(row)
            if base is not None:
                base.measure(rows[-1]["bytes"])
            src.free("s")
            src.check_integrity()
    finally:
        recv.close()
    return rows


def quiet_nixl() -> None:
    """NIXL logs an INFO line to stdout for each agent and backend it makes, in the middle of this
    bench's progress: keep it to warnings, unless NIXL_LOG_LEVEL already says otherwise. NIXL reads
    that variable when first imported (a peer process inherits it); its `nixl` logger is set too,
    for a process that imported it already."""
    if os.environ.get("NIXL_LOG_LEVEL"):
        return
    os.environ["NIXL_LOG_LEVEL"] = "WARN"
    logging.getLogger("nixl").setLevel(logging.WARNING)


def run_bench(cfg: BenchConfig, log=print, baselines=None) -> dict:
    """Run every point and, with cfg.baselines, the baselines: `baselines(peer, repeats, log, device)` makes
    the object that measures them (`bench.baselines.Baselines`: the benchmark's, kept out of the product
    since it pickles over a pipe as the naive approach it compares against); returns {"machine":
    measure.machine.describe(), "results": [...], "baselines": [...], "timeline": [...]} (timeline: one
    record per timed migration, see `bench.migrate_trace`)."""
    if cfg.baselines and baselines is None:
        raise ValueError("cfg.baselines needs run_bench's `baselines` (e.g. bench.baselines.Baselines)")
    quiet_nixl()
    shapes = [(name, parse_kv_shape(name)) for name in cfg.kv_shapes]
    unknown = set(cfg.transports) - set(TRANSPORTS)
    if unknown:
        raise ValueError(f"unknown transports {sorted(unknown)}; choose from {TRANSPORTS}")
    from transfer.channels.nixl_pool import available

    if "nixl" in cfg.transports and not available():  # NOTE: the one optional transport: skipped, said
        log("nixl is not installed: the nixl transport is skipped (pip install 'pdserve[nixl]')")
        cfg = dataclasses.replace(cfg, transports=tuple(t for t in cfg.transports if t != "nixl"))
    if cfg.device != "cpu" and _actors(cfg.transports):
        raise ValueError("device pools are benchmarked over the zmq transports only "
                         "(--transports zmq-tcp,zmq-ipc)")
    from measure.machine import describe, summary

    threads = torch.get_num_threads()
    # one torch thread, as every worker (runtime.actor) and the peer: an idle OpenMP pool's threads
    # spin after each op and take the core ZeroMQ's I/O thread needs (64 KiB p50 2.2-2.4 -> 1.4-1.7 ms)
    torch.set_num_threads(1)
    where = describe()  # convention 16: where it ran, bandwidth measured before any point
    log(summary(where))
    gen = torch.Generator().manual_seed(1234)
    total = len(shapes) * len(cfg.block_sizes) * len(cfg.tokens) * len(cfg.transports)
    count, t_start = [0], time.monotonic()

    def progress(row: dict) -> None:
        count[0] += 1
        log(f"[{count[0]}/{total} {time.monotonic() - t_start:5.1f}s] {row['transport']:8s} "
            f"{row['kv_shape']} T={row['tokens']} B={row['block_size']}: p50 {row['latency_ms_p50']:.2f} ms, "
            f"p99 {row['latency_ms_p99']:.2f} ms, {row['gb_per_s']:.2f} GB/s, verified={row['verified']}")

    peer = PeerProcess() if len(_actors(cfg.transports)) < len(cfg.transports) or cfg.baselines else None
    ray_started, results, store, base, timeline = False, [], 0, None, []
    origin = time.perf_counter()
    try:
        base = baselines(peer, cfg.repeats, log, cfg.device) if cfg.baselines else None
        if _actors(cfg.transports):
            import ray

            token_bytes = max(KVLayout(L, H, D, 1, dt).token_bytes for _, (L, H, D, dt) in shapes)
            largest = token_bytes * (max(cfg.tokens) + max(cfg.block_sizes))
            store = int(min(max(4 * largest, 256 << 20), 8 << 30))
            log(f"starting Ray (object store {store >> 20} MiB) ...")
            ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=store,
                     log_to_driver=False)
            ray_started = True
        for shape_name, (L, H, D, dtype) in shapes:
            for B in cfg.block_sizes:
                results += _run_layout(cfg, peer, shape_name, (L, H, D, B, dtype), gen, progress, store, base,
                                       timeline, origin)
    finally:
        torch.set_num_threads(threads)
        if base is not None:
            base.close()
        if peer is not None:
            peer.close()
        if ray_started:
            import ray

            ray.shutdown()
    return {"machine": where, "results": results, "baselines": base.rows if base is not None else [],
            "timeline": timeline}

