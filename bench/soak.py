"""`pdserve bench soak`: a steady request rate held against a local cluster for M minutes, with each
worker's memory (RSS) and free blocks sampled over time, so a leak shows as a slope.

One cluster (1 prefill + 2 decode workers on an embedded local Ray by default) serves Poisson
arrivals at `rate` requests/s (random byte-level prompts, greedy and seeded sampling, half of
them streamed; at most `max_in_flight` at once: an arrival beyond that is counted as skipped,
never queued, so the rate stays open-loop). Every `sample_s` seconds a sampler reads /v1/cluster
and each worker's resident set size from /proc/<pid>/status (every worker runs on this machine),
plus this process's own (the coordinator). At the end the load stops, the cluster is left to come
to rest, and one more sample is taken. Slopes are least-squares fits per worker over the samples
after the warm-up (the first quarter of the run, at most `warmup_s`): RSS in MiB/min, available
blocks (free + cached: what a new request can get) and free blocks in blocks/min. Progress goes
to stderr; `plot` draws RSS and available blocks per worker against time.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np

from bench.chaos_client import ChaosRequest, send
from bench.chaos_faults import cluster_info


@dataclass(frozen=True)
class SoakConfig:
    """seconds: run length. rate: Poisson arrivals per second. sample_s: sampling period.
    max_in_flight: requests in flight at most (beyond: skipped). warmup_s: longest warm-up left out
    of the slopes. prefill / decode / num_blocks / transport: the cluster. rest_timeout_s: bound
    on waiting for rest at the end. seed: prompts and arrivals."""

    seconds: float = 20 * 60.0
    rate: float = 2.0
    sample_s: float = 2.0
    max_in_flight: int = 16
    warmup_s: float = 60.0
    prefill: int = 1
    decode: int = 2
    num_blocks: int = 512
    transport: str = "zmq"
    rest_timeout_s: float = 60.0
    request_timeout_s: float = 120.0
    start_timeout_s: float = 240.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.seconds > 0 or not self.rate > 0 or not self.sample_s > 0 or self.max_in_flight < 1:
            raise ValueError("seconds, rate and sample_s must be > 0 and max_in_flight >= 1")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def sample(port: int, t0: float) -> dict:
    info = cluster_info(port)
    workers = {w["name"]: {"role": w["role"], "alive": w["alive"],
                           "rss_mib": rss_mib(w["pid"]) if w.get("pid") else None,
                           "free_blocks": w["free_blocks"], "cached_blocks": w["cached_blocks"],
                           "used_blocks": w["used_blocks"]} for w in info["workers"]}
    return {"t_s": round(time.monotonic() - t0, 2), "workers": workers,
            "coordinator_rss_mib": rss_mib(os.getpid()), "active_requests": info["ledger"]["active_requests"]}


def _request(rng: np.random.Generator, i: int) -> ChaosRequest:
    prompt = [int(x) for x in rng.integers(32, 127, size=int(rng.integers(16, 257)))]
    params = {"max_tokens": int(rng.integers(8, 49)), "temperature": 0, "ignore_eos": True}
    if i % 2:
        params.update(temperature=0.8, top_k=40, seed=int(rng.integers(1, 2**31)))
    return ChaosRequest(i, prompt, params, stream=(i // 2) % 2 == 1)


def _slope(ts: list[float], ys: list) -> float | None:
    pts = [(t, y) for t, y in zip(ts, ys) if y is not None]
    if len(pts) < 3:
        return None
    t, y = np.array(pts, dtype=float).T
    return float(np.polyfit(t / 60.0, y, 1)[0])  # per minute


def slopes(samples: list[dict], warmup_s: float) -> dict:
    kept = [s for s in samples if s["t_s"] >= warmup_s] or samples
    ts = [s["t_s"] for s in kept]
    names = sorted({n for s in kept for n in s["workers"]})
    out = {}
    for n in names:
        rows = [s["workers"].get(n) for s in kept]
        available = [r and r["free_blocks"] + r["cached_blocks"] for r in rows]
        out[n] = {"rss_mib_per_min": _slope(ts, [r and r["rss_mib"] for r in rows]),
                  "available_blocks_per_min": _slope(ts, available),
                  "free_blocks_per_min": _slope(ts, [r and r["free_blocks"] for r in rows])}
    out["coordinator"] = {"rss_mib_per_min": _slope(ts, [s["coordinator_rss_mib"] for s in kept])}
    return out


def drive(port: int, cfg: SoakConfig, log) -> tuple[list[dict], Counter]:
    """The load and the sampler for cfg.seconds; the samples and the request counts."""
    rng = np.random.default_rng(cfg.seed)
    counts: Counter = Counter()
    lock, in_flight = threading.Lock(), [0]
    samples: list[dict] = []
    t0 = time.monotonic()

    def one(req: ChaosRequest) -> None:
        out = send(port, req, cfg.request_timeout_s)
        with lock:
            in_flight[0] -= 1
            counts["answered" if out.end == "answer" else "failed"] += 1

    next_sample, next_log, arrival, i = t0, t0, t0, 0
    with concurrent.futures.ThreadPoolExecutor(cfg.max_in_flight) as pool:
        while True:
            now = time.monotonic()
            if now - t0 >= cfg.seconds:
                break
            if now >= next_sample:
                samples.append(sample(port, t0))
                next_sample += cfg.sample_s
            if now >= next_log:
                log(f"  soak {now - t0:6.0f}/{cfg.seconds:.0f} s: {dict(counts)}; "
                    + ", ".join(f"{n} {w['rss_mib']:.0f} MiB {w['free_blocks'] + w['cached_blocks']} avail"
                                for n, w in samples[-1]["workers"].items() if w["rss_mib"]))
                next_log += max(10.0, cfg.seconds / 20)
            if now >= arrival:
                with lock:
                    busy = in_flight[0] >= cfg.max_in_flight
                    in_flight[0] += 0 if busy else 1
                counts["skipped" if busy else "sent"] += 1
                if not busy:
                    pool.submit(one, _request(rng, i))
                i += 1
                arrival += float(rng.exponential(1.0 / cfg.rate))
            time.sleep(max(0.0, min(arrival, next_sample, t0 + cfg.seconds) - time.monotonic()))
    return samples, counts


def run_soak(cfg: SoakConfig, log=_log) -> dict:
    from bench.chaos import ChaosConfig, cluster_config, wait_at_rest
    from deploy.launch import ClusterServer, RayConfig, start_ray, stop_ray

    c = ChaosConfig(prefill=cfg.prefill, decode=cfg.decode, num_blocks=cfg.num_blocks,
                    transport=cfg.transport, rest_timeout_s=cfg.rest_timeout_s,
                    start_timeout_s=cfg.start_timeout_s)  # the same cluster as the chaos benchmark's

    started = start_ray(RayConfig(num_cpus=2))
    try:
        srv = ClusterServer(cluster_config(c))
        try:
            port = srv.start(timeout=cfg.start_timeout_s)
            log(f"soak: cluster up on port {port}; {cfg.rate:g} req/s for {cfg.seconds:g} s, "
                f"a sample every {cfg.sample_s:g} s")
            t0 = time.monotonic()
            samples, counts = drive(port, cfg, log)
            info, leaked = wait_at_rest(port, c)
            final = sample(port, t0)
        finally:
            srv.stop()
    finally:
        stop_ray(started)
    warmup = min(cfg.warmup_s, cfg.seconds / 4)
    return {"config": asdict(cfg), "duration_s": round(cfg.seconds, 1), "requests": dict(counts),
            "samples": samples, "at_rest": {**final, "leaked_blocks": leaked}, "slope_after_s": warmup,
            "slopes": slopes(samples, warmup)}


def format_slopes(report: dict) -> str:
    def f(v, digits=2):
        return "-" if v is None else f"{v:+.{digits}f}"

    lines = ["| worker | RSS first -> last (MiB) | RSS slope (MiB/min) | available blocks first -> last "
             "| available slope (blocks/min) |", "|---|---|---|---|---|"]
    first, last = report["samples"][0], report["samples"][-1]
    for name, s in report["slopes"].items():
        if name == "coordinator":
            a, b, av = first["coordinator_rss_mib"], last["coordinator_rss_mib"], "-"
        else:
            w0, w1 = first["workers"].get(name), last["workers"].get(name)
            a, b = (w0 or {}).get("rss_mib"), (w1 or {}).get("rss_mib")
            av = "-" if not (w0 and w1) else (f"{w0['free_blocks'] + w0['cached_blocks']} -> "
                                               f"{w1['free_blocks'] + w1['cached_blocks']}")
        rss = "-" if a is None or b is None else f"{a:.0f} -> {b:.0f}"
        lines.append(f"| {name} | {rss} | {f(s['rss_mib_per_min'])} | {av} | "
                     f"{f(s.get('available_blocks_per_min'))} |")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["samples"]
    ts = [s["t_s"] / 60.0 for s in samples]
    names = sorted({n for s in samples for n in s["workers"]})
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for k, n in enumerate(names):
        rows, color = [s["workers"].get(n) for s in samples], f"C{k}"
        ax1.plot(ts, [r and r["rss_mib"] for r in rows], color=color, label=n)
        ax2.plot(ts, [r and r["free_blocks"] + r["cached_blocks"] for r in rows], color=color,
                 label=f"{n} free + cached")
        ax2.plot(ts, [r and r["free_blocks"] for r in rows], color=color, ls="--", lw=0.8,
                 label=f"{n} free (the rest holds cached prefixes)")
    ax1.plot(ts, [s["coordinator_rss_mib"] for s in samples], color=f"C{len(names)}",
             label="coordinator (this process)")
    ax1.set_ylabel("RSS (MiB)")
    minutes = report["duration_s"] / 60
    ax1.set_title(f"pdserve bench soak: {report['config']['rate']:g} req/s for {minutes:.1f} min")
    ax1.legend(fontsize=8)
    ax2.set_ylabel("blocks")
    ax2.set_xlabel("minutes")
    ax2.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
