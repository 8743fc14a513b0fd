"""`pdserve bench serve`: disaggregated, colocated and per-request serving under the same open-loop load.

For each setup it brings a cluster up with `deploy.launch.ClusterServer` on one embedded local
Ray (started once; clusters brought up one after another and always shut down), or targets a
running coordinator (`url`, one mode named by `mode`). The setups: the disaggregated mode once
per `streamed` value (KV migration streamed while the prompt is still prefilling, and whole after
it; `ClusterConfig.stream_migration`), so one invocation compares the two, the colocated mode
once, and the per-request mode once (`disaggregate='auto'`, coordinator.decide; runs record the
paths taken); the `mixed` preset (bench.serve_mixed) is its workload.
Every setup's engines get the same engine settings, the step budget included
(`step_budget` tokens per engine step, 512 by default: below most of the long-prompt preset's
prompts, so they prefill in chunks and a disaggregated prompt's KV can leave while it computes;
the colocated engines get the same budget, so neither mode gets a bigger batch).

Per setup: a short warm-up, then the overhead measurement vLLM uses for disaggregation (requests
one at a time at low load: prefill-only ones with max_tokens=1 against full ones of the same
lengths, so the TTFT that migration adds is seen alone), then one open-loop run
(`bench.loadgen`) per request rate. The load client runs in a child process
(`bench.serve_client`, JSON lines over a pipe), never on the coordinator's GIL; each run records
the client's pid. A full run sends 200 requests per point, so p99 interpolates between the 2nd
and 3rd slowest, not the slowest; `QUICK` sends fewer and says so (p99 at fewer than 101
requests is pulled toward the maximum). Every run is summarised from client-side records by
`bench.serve_metrics.summarize` (TTFT, TPOT, ITL, e2e percentiles, throughput, goodput under the
SLO, migration share of TTFT, streamed migrations' overlap and exposed ms, and vLLM's names for
them); `bench.serve_report` formats the tables and draws the plot. Every prompt set is drawn from
its own seed (the same seeds for every setup), so no run hits another's prefix cache.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace

import numpy as np

from bench import loadgen
from bench.loadgen import RequestRecord, RequestSpec, Workload, make_requests, preset
from bench.serve_client import load_in_subprocess
from bench.serve_metrics import SLO, mean_or_none, meets_slo, percentiles, present, summarize, ttft_ms
from bench.serve_mixed import mixed_requests, path_counts
from bench.serve_report import fmt, format_run

MODES = ("disaggregated", "colocated", "per_request")
FULL_REQUESTS = 200  # per point in a full run: p99 then sits between the 2nd and 3rd slowest
P99_BELOW_MAX = 101  # fewer requests than this: numpy's p99 interpolates with the slowest one


@dataclass(frozen=True)
class ServeBenchConfig:
    """modes: which to compare (brought up here unless `url`). streamed: the disaggregated mode
    runs once per value (ClusterConfig.stream_migration; the colocated mode migrates nothing and
    runs once, labelled streamed=False). rates: request rates (req/s), one run each.
    num_requests: per run. preset: loadgen preset of the length distributions. prefill / decode:
    engines of the disaggregated mode; the colocated mode gets prefill + decode engines doing both
    phases. step_budget: tokens per engine step (max_num_batched_tokens) of every engine in every
    mode. transport: KV migration transport (every one streams). block_size / num_blocks: each
    engine's KV pool. url / mode: a running coordinator and its mode (then `modes` and `streamed`
    are ignored; a run's `streamed` says whether any of its migrations streamed). slo: goodput
    thresholds. seed: base seed of every prompt set. overhead_requests: requests per kind in the
    overhead measurement (0 skips it). warmup_requests: sent before measuring. request_timeout_s:
    bound on one request. start_timeout_s: bound on a cluster coming up. detailed: also write
    every request's client record (times relative to its run's start). quick: a shortened run
    (recorded, and the p99 caveat printed)."""

    modes: tuple[str, ...] = MODES
    streamed: tuple[bool, ...] = (True, False)
    rates: tuple[float, ...] = (1.0, 2.0, 3.0, 4.0, 6.0)
    num_requests: int = FULL_REQUESTS
    preset: str = "long-prompt-short-output"
    prefill: int = 1
    decode: int = 1
    step_budget: int = 512
    transport: str = "zmq"
    block_size: int = 16
    num_blocks: int = 1024
    url: str | None = None
    mode: str = "disaggregated"
    slo: SLO = SLO()
    seed: int = 0
    overhead_requests: int = 8
    warmup_requests: int = 3
    request_timeout_s: float = 120.0
    start_timeout_s: float = 240.0
    detailed: bool = False
    quick: bool = False

    def __post_init__(self) -> None:
        for m in (*self.modes, self.mode):
            if m not in MODES:
                raise ValueError(f"mode must be one of {MODES}, got {m!r}")
        if not self.rates or any(not (r > 0 and math.isfinite(r)) for r in self.rates):
            raise ValueError(f"rates must be finite and > 0 requests/s, got {self.rates}")
        if self.num_requests < 1 or self.prefill < 1 or self.decode < 1 or self.step_budget < 1:
            raise ValueError("num_requests, prefill, decode and step_budget must be >= 1")
        if not self.streamed or len(set(self.streamed)) != len(self.streamed):
            raise ValueError(f"streamed must name True and/or False once each, got {self.streamed}")


QUICK = ServeBenchConfig(rates=(1.5, 3.0, 5.0), num_requests=40, overhead_requests=4, warmup_requests=2,
                         quick=True)


def p99_note(n: int) -> str | None:
    """What a reader should know about p99 at n requests per point (None when it is not the max)."""
    if n >= P99_BELOW_MAX:
        return None
    return (f"{n} requests per point: p99 interpolates with the slowest request (p99 ≈ max); "
            f"a full run sends {FULL_REQUESTS}")


def setups(cfg: ServeBenchConfig) -> list[tuple[str, bool]]:
    """(mode, streamed) per cluster brought up, in `cfg.modes` order."""
    out: list[tuple[str, bool]] = []
    for mode in cfg.modes:
        if mode == "colocated":
            out.append((mode, False))
        elif mode == "per_request":  # once, with the cluster's default migration (streamed)
            out.append((mode, True))
        else:  # every transport streams (over the data stream, or chunk messages where there is none)
            out += [(mode, s) for s in cfg.streamed]
    return out


def label(mode: str, streamed: bool) -> str:
    """A setup's name in the report: 'disaggregated' (streamed, the cluster default),
    'disaggregated-whole' (stream_migration off), 'colocated', 'per-request'."""
    if mode == "per_request":
        return "per-request"
    return f"{mode}-whole" if mode == "disaggregated" and not streamed else mode


# ---- running ---------------------------------------------------------------------------------
def _workload(cfg: ServeBenchConfig, rate: float, n: int, seed: int) -> Workload:
    return preset(cfg.preset, rate, n, seed)


def _requests(cfg: ServeBenchConfig, rate: float, n: int, seed: int) -> list[RequestSpec]:
    if cfg.preset == "mixed":
        return mixed_requests(rate, n, seed)
    return make_requests(_workload(cfg, rate, n, seed))



def _progress(log, name: str, total: int):
    step, state = max(1, total // 5), {"done": 0, "failed": 0}

    def on_done(rec: RequestRecord) -> None:
        state["done"] += 1
        state["failed"] += int(not rec.ok)
        if state["done"] % step == 0 or state["done"] == total:
            log(f"  [{name}] {state['done']}/{total} done, {state['failed']} failed")

    return on_done


def _load(url: str, specs: list[RequestSpec], cfg: ServeBenchConfig, progress=None, sequential=False):
    """(records, duration s, client pid): the load client runs in a child process."""
    return load_in_subprocess(url, specs, cfg.request_timeout_s, sequential=sequential, progress=progress)


def _sequential(url: str, specs: list[RequestSpec], cfg: ServeBenchConfig) -> list[RequestRecord]:
    return _load(url, specs, cfg, sequential=True)[0]


def measure_overhead(url: str, cfg: ServeBenchConfig, log) -> dict:
    """Requests one at a time: max_tokens=1 (prefill only, never migrated) against full ones of
    the same prompt lengths (fresh prompts each, so no prefix-cache hits)."""
    n = cfg.overhead_requests
    base = _requests(cfg, 1.0, n, cfg.seed + 1000)
    rng, (lo, hi) = np.random.default_rng(cfg.seed + 2000), loadgen.PROMPT_ID_RANGE
    full = [replace(s, prompt=[int(x) for x in rng.integers(lo, hi, size=len(s.prompt))]) for s in base]
    only = [replace(s, max_tokens=1) for s in base]
    a, b = _sequential(url, only, cfg), _sequential(url, full, cfg)
    res = {"requests": n}
    for name, recs in (("prefill_only", a), ("full", b)):
        ok = [r for r in recs if r.ok]
        res[name] = {"completed": len(ok), "failed": len(recs) - len(ok),
                     "ttft_ms": percentiles([ttft_ms(r) for r in ok]),
                     "mean_ttft_ms": mean_or_none([ttft_ms(r) for r in ok]),
                     "server_ttft_ms": percentiles(present(ok, "server_ttft_ms")),
                     "migration_ms": percentiles(present(ok, "migration_ms"))}
    for key, name in (("ttft_ms", "added_ttft_ms_p50"), ("server_ttft_ms", "added_server_ttft_ms_p50")):
        a50, b50 = res["prefill_only"][key]["p50"], res["full"][key]["p50"]
        res[name] = None if a50 is None or b50 is None else b50 - a50
    streamed = [r for r in b if r.ok and r.overlap_pct is not None]
    res["full"]["streamed_migrations"] = len(streamed)
    p_only, p_full = res["prefill_only"]["ttft_ms"]["p50"], res["full"]["ttft_ms"]["p50"]
    mig = res["full"]["migration_ms"]["p50"]
    log(f"  overhead: TTFT p50 prefill-only {fmt(p_only)} ms, full {fmt(p_full)} ms "
        f"(added {fmt(res['added_ttft_ms_p50'])} ms; migration p50 {fmt(mig)} ms, "
        f"{len(streamed)}/{len(b)} streamed)")
    return res


def bench_target(url: str, mode: str, cfg: ServeBenchConfig, log,
                 streamed: bool | None = None) -> tuple[list[dict], dict | None]:
    """Warm-up, overhead, then one run per rate against the coordinator at `url`. streamed: the
    cluster's stream_migration (None: unknown, a run is labelled by whether any migration streamed)."""
    if cfg.warmup_requests:
        _sequential(url, _requests(cfg, 1.0, cfg.warmup_requests, cfg.seed + 3000), cfg)
    overhead = measure_overhead(url, cfg, log) if cfg.overhead_requests else None
    if overhead is not None:
        overhead.update(mode=mode, streamed=bool(streamed) if streamed is not None
                        else overhead["full"]["streamed_migrations"] > 0)
    runs = []
    for i, rate in enumerate(cfg.rates):
        specs = _requests(cfg, rate, cfg.num_requests, cfg.seed + 1 + i)
        kind = "" if streamed is None or mode == "colocated" else ", streamed" if streamed else ", whole"
        name = f"{mode}{kind} @ {rate:g} req/s"
        log(f"{name}: {len(specs)} requests, {cfg.preset}")
        before = path_counts(url)  # per request: where each prompt was prefilled (coordinator.decide)
        records, dur, pid = _load(url, specs, cfg, _progress(log, name, len(specs)))
        run = {"mode": mode, "rate": rate, "num_requests": len(specs), **summarize(records, dur, cfg.slo)}
        run["slo_met"] = [bool(r.ok and meets_slo(r, cfg.slo)) for r in records]  # per request, in send order
        after = path_counts(url)
        run["paths"] = {k: int(v - before.get(k, 0)) for k, v in after.items() if v > before.get(k, 0)}
        run["streamed"] = bool(streamed) if streamed is not None else run["streamed_migrations"] > 0
        run["label"] = label(mode, run["streamed"])
        run["client_pid"] = pid
        if cfg.detailed:
            t0 = min(r.send_s for r in records)
            run["requests"] = [_detail(r, t0) for r in records]
        log(f"  {format_run(run)}" + (f"\n  paths: {run['paths']}" if run["paths"] else ""))
        expect = sum(r.ok and r.output_tokens > 1 for r in records) if mode == "disaggregated" else 0
        if run["migrated"] != expect and mode != "per_request":  # say it: work done elsewhere
            log(f"  WARNING: {run['migrated']} requests report a KV migration; {mode} mode expects {expect}")
        if streamed and mode == "disaggregated" and run["streamed_migrations"] == 0:
            log("  WARNING: stream_migration is on but no migration streamed (prompts within one step?)")
        if streamed is False and run["streamed_migrations"]:
            log(f"  WARNING: stream_migration is off but {run['streamed_migrations']} migrations streamed")
        runs.append(run)
    return runs, overhead


def _detail(r: RequestRecord, t0: float) -> dict:
    d = r.to_dict()
    for k in ("send_s", "first_s", "end_s"):
        d[k] = None if d[k] is None else d[k] - t0
    d["chunk_s"] = [t - t0 for t in d["chunk_s"]]
    return d


def cluster_config(mode: str, cfg: ServeBenchConfig, streamed: bool = True):
    """The ClusterConfig of one setup: the same engine settings (step budget) in every mode."""
    from coordinator.cluster import ClusterConfig

    common = {"transport": cfg.transport, "model": "tiny", "block_size": cfg.block_size,
              "num_blocks": cfg.num_blocks, "start_timeout_s": cfg.start_timeout_s,
              "engine": {"scheduler": {"max_num_batched_tokens": cfg.step_budget}}}
    if mode in ("disaggregated", "per_request"):
        return ClusterConfig(prefill=cfg.prefill, decode=cfg.decode, stream_migration=streamed,
                             disaggregate="auto" if mode == "per_request" else "always", **common)
    try:
        return ClusterConfig(colocated=cfg.prefill + cfg.decode, stream_migration=False, **common)
    except TypeError:
        raise RuntimeError("this build's ClusterConfig has no 'colocated' field: run with "
                           "--modes disaggregated") from None


def run_bench(cfg: ServeBenchConfig, log=print) -> dict:
    """The whole benchmark; returns the JSON report (slo, config, runs, overhead per setup label)."""
    runs: list[dict] = []
    overhead: dict = {}
    note = p99_note(cfg.num_requests)
    if note:
        log(f"{'quick: ' if cfg.quick else 'NOTE: '}{note}")
    if cfg.url:
        r, o = bench_target(cfg.url, cfg.mode, cfg, log)
        runs += r
        overhead[label(cfg.mode, o["streamed"]) if o else cfg.mode] = o
    else:
        from deploy.launch import ClusterServer, RayConfig, start_ray, stop_ray

        started = start_ray(RayConfig(num_cpus=2))
        try:
            for mode, streamed in setups(cfg):
                t0 = time.perf_counter()
                srv = ClusterServer(cluster_config(mode, cfg, streamed))
                try:
                    port = srv.start(timeout=cfg.start_timeout_s)
                    log(f"== {label(mode, streamed)} (stream_migration {'on' if streamed else 'off'}): "
                        f"cluster up on port {port} in {time.perf_counter() - t0:.1f} s ==")
                    r, o = bench_target(f"http://127.0.0.1:{port}", mode, cfg, log, streamed)
                    runs += r
                    overhead[label(mode, streamed)] = o
                finally:
                    srv.stop()
        finally:
            stop_ray(started)
    return {"slo": {"ttft_ms": cfg.slo.ttft_ms, "tpot_ms": cfg.slo.tpot_ms},
            "config": {"preset": cfg.preset, "rates": list(cfg.rates), "num_requests": cfg.num_requests,
                       "modes": [cfg.mode] if cfg.url else list(cfg.modes), "prefill": cfg.prefill,
                       "decode": cfg.decode, "transport": cfg.transport, "seed": cfg.seed,
                       "url": cfg.url, "model": "tiny",
                       "streamed": None if cfg.url else [s for m, s in setups(cfg) if m == "disaggregated"],
                       "step_budget": None if cfg.url else cfg.step_budget, "quick": cfg.quick,
                       "p99_note": note, "bench_pid": os.getpid(), "client": "subprocess"},
            "runs": runs, "overhead": overhead}
