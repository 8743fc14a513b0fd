"""`pdserve bench serve`: disaggregated, colocated and per-request serving under the same open-loop load,
on the real model (SmolLM2 by default; `model='tiny'` for tests and smoke runs).

For each setup it brings a cluster up with `deploy.launch.ClusterServer` on one embedded local
Ray (started once; clusters brought up one after another and always shut down), or targets a
running coordinator (`url`, one mode named by `mode`). The setups (`setups`): colocated once per
chunk budget in `colocated_budgets` (max_num_batched_tokens, Sarathi-Serve's knob: the best one is
the baseline, `best_colocated`), the disaggregated mode at P:D = `prefill`:`decode` once per
`streamed` value (KV migration streamed while the prompt is still prefilling, and whole after it),
and the per-request mode once (`disaggregate='auto'`, coordinator.decide; runs record the paths
taken). Every worker computes on one thread pinned to a core of its own (`pin_workers`,
ClusterConfig.pin_cpus), as a GPU owns its device; where there are fewer cores than workers two
share one, and the report's `placement` says so, with the cores left for the coordinator and the
load client.

Per setup: a short warm-up, then the overhead measurement vLLM uses for disaggregation (requests
one at a time: prefill-only ones with max_tokens=1 against full ones of the same lengths, so the
TTFT that migration adds is seen alone). On the first setup it is also the calibration: the SLOs
are multiples of its unloaded TTFT and TPOT p50 (measure.serve_slo, DistServe's way), the same for
every setup after. Then the goodput search (measure.serve_goodput: the highest rate at which >= 90%
of requests meet both SLOs, by bisection over rates, with a bootstrap interval), each step one
open-loop run of `num_requests` requests (`measure.loadgen`); or, given `rates`, one run per rate.
The load client runs in a child process (`measure.serve_client`, JSON lines over a pipe), never on
the coordinator's GIL; each run records the client's pid. Every run is summarised from client-side
records by `measure.serve_metrics.summarize`; `measure.serve_report` formats the tables and draws the
plot. Workloads: measure.loadgen's presets, `mixed` (measure.serve_mixed, shared prefixes), or a
Mooncake JSONL trace (`trace`, measure.serve_trace: rescaled to each rate). Every run's prompts come
from its own seed (the trace's from its own salt), the same seeds for every setup, so no run hits
another's prefix cache.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace

import numpy as np

from measure import loadgen, serve_slo
from measure import serve_goodput as sg
from measure.loadgen import RequestRecord, RequestSpec, Workload, make_requests, preset
from measure.serve_client import load_in_subprocess
from measure.serve_metrics import (
    SLO,
    mean_or_none,
    meets_slo,
    percentiles,
    present,
    summarize,
    tpot_ms,
    ttft_ms,
)
from measure.serve_mixed import mixed_requests, path_counts
from measure.serve_report import fmt, format_run
from measure.serve_slo import SLOScale

MODES = ("colocated", "disaggregated", "per_request")
PRESETS = (*loadgen.PRESETS, "mixed")
FULL_REQUESTS = 200  # per point in a full run: p99 then sits between the 2nd and 3rd slowest
P99_BELOW_MAX = 101  # fewer requests than this: numpy's p99 interpolates with the slowest one


@dataclass(frozen=True)
class ServeBenchConfig:
    """modes: which to compare (brought up here unless `url`). streamed: the disaggregated mode
    runs once per value (ClusterConfig.stream_migration; the colocated mode migrates nothing and
    runs once per chunk budget, labelled streamed=False). rates: fixed request rates (req/s), one
    run each; () runs the goodput search instead (measure.serve_goodput). num_requests: per run (per
    search step). preset: loadgen preset of the length distributions, or 'mixed'. trace: a Mooncake
    JSONL file to replay instead (measure.serve_trace; its first num_requests records, rescaled to
    each rate). model / weights: what every engine serves ('smollm2' for results, 'tiny' for tests
    and smoke runs; weights None: bf16/gguf as `pdserve up` picks, nothing for tiny). prefill /
    decode: engines of the disaggregated mode; the colocated mode gets prefill + decode engines doing
    both phases. step_budget: tokens per engine step (max_num_batched_tokens) of the disaggregated
    engines. colocated_budgets: the colocated mode's chunk budgets, one setup each (): step_budget.
    step_target_s: ClusterConfig.step_target_s, the engines' step pacer; 0 (default) turns it off so
    that a step is the chunk budget (the knob compared), None keeps the cluster's default.
    decide_profile: a `pdserve profile --json` file whose crossover and prefill ms per token price the
    per-request mode's decisions (coordinator.decide.from_profile); None: the decode worker's own
    startup timing.
    pin_workers: every worker on one thread and a core of its own (ClusterConfig.pin_cpus).
    transport: KV migration transport. block_size / num_blocks: each engine's KV pool. url / mode:
    a running coordinator and its mode (then `modes` and `streamed` are ignored). slo: the fixed
    SLOs (used where slo_scale's multiple is None). slo_scale: the SLO multiples of the unloaded
    TTFT and TPOT (measure.serve_slo). search_steps: measurements per goodput search; search_start:
    its first rate (None: from the unloaded times, the same for every setup); search_span: it stays
    within [start / span, start x span] (a goodput below is reported as 0 with the bracket's failing
    rate: it bounds the run's length, since a step at rate r takes num_requests / r s). seed: base seed of
    every prompt set. overhead_requests: requests per kind in the overhead measurement, the
    calibration (0 skips it: then the SLOs must be fixed). warmup_requests: sent before measuring.
    request_timeout_s: bound on one request. start_timeout_s: bound on a cluster coming up.
    detailed: also write every request's client record. quick: a shortened run (recorded, and the
    p99 caveat printed)."""

    modes: tuple[str, ...] = MODES
    streamed: tuple[bool, ...] = (True, False)
    rates: tuple[float, ...] = ()
    num_requests: int = FULL_REQUESTS
    preset: str = "long-prompt-long-output"
    trace: str | None = None
    model: str = "smollm2"
    weights: str | None = None
    prefill: int = 1
    decode: int = 1
    step_budget: int = 512
    colocated_budgets: tuple[int, ...] = (128, 256, 512)
    step_target_s: float | None = 0.0
    decide_profile: str | None = None
    pin_workers: bool = True
    transport: str = "zmq"
    block_size: int = 16
    num_blocks: int = 1024
    url: str | None = None
    mode: str = "disaggregated"
    slo: SLO = SLO()
    slo_scale: SLOScale = SLOScale()
    search_steps: int = 6
    search_start: float | None = None
    search_span: float = 8.0
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
        if any(not (r > 0 and math.isfinite(r)) for r in self.rates):
            raise ValueError(f"rates must be finite and > 0 requests/s, got {self.rates}")
        if self.num_requests < 1 or self.prefill < 1 or self.decode < 1 or self.step_budget < 1:
            raise ValueError("num_requests, prefill, decode and step_budget must be >= 1")
        if any(b < 1 for b in self.colocated_budgets) or len(set(self.colocated_budgets)) != len(
                self.colocated_budgets):
            raise ValueError(f"colocated budgets must be distinct and >= 1, got {self.colocated_budgets}")
        if not self.streamed or len(set(self.streamed)) != len(self.streamed):
            raise ValueError(f"streamed must name True and/or False once each, got {self.streamed}")
        if self.trace is None and self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose from {', '.join(PRESETS)}")
        if self.search_steps < 1 or not self.search_span > 1:
            raise ValueError(f"search_steps must be >= 1 and search_span > 1, got {self.search_steps}, "
                             f"{self.search_span}")
        if self.search_start is not None and not (self.search_start > 0 and math.isfinite(self.search_start)):
            raise ValueError(f"search_start must be finite and > 0 requests/s, got {self.search_start}")
        if not self.slo_scale.fixed and self.overhead_requests < 1:
            raise ValueError("scaled SLOs need the calibration (overhead_requests >= 1), "
                             "or give both SLOs in ms")


QUICK = ServeBenchConfig(num_requests=20, search_steps=4, search_span=4.0, preset="mixed", streamed=(True,),
                         colocated_budgets=(128, 512), overhead_requests=4, warmup_requests=2, quick=True)


@dataclass(frozen=True)
class Setup:
    """One cluster brought up: its mode, whether its migrations stream, its engines' chunk budget
    (max_num_batched_tokens) and its name in the report."""

    mode: str
    streamed: bool
    step_budget: int
    label: str


def p99_note(n: int) -> str | None:
    """What a reader should know about p99 at n requests per point (None when it is not the max)."""
    if n >= P99_BELOW_MAX:
        return None
    return (f"{n} requests per point: p99 interpolates with the slowest request (p99 ≈ max); "
            f"a full run sends {FULL_REQUESTS}")


def colocated_budgets(cfg: ServeBenchConfig) -> tuple[int, ...]:
    return cfg.colocated_budgets or (cfg.step_budget,)


def setups(cfg: ServeBenchConfig) -> list[Setup]:
    """The clusters brought up, in `cfg.modes` order."""
    out: list[Setup] = []
    for mode in cfg.modes:
        if mode == "colocated":
            budgets = colocated_budgets(cfg)
            out += [Setup(mode, False, b, label(mode, False, b if len(budgets) > 1 else None))
                    for b in budgets]
        elif mode == "per_request":  # once, with the cluster's default migration (streamed)
            out.append(Setup(mode, True, cfg.step_budget, label(mode, True)))
        else:  # every transport streams (over the bulk link, or chunk messages where there is none)
            out += [Setup(mode, s, cfg.step_budget, label(mode, s)) for s in cfg.streamed]
    return out


def label(mode: str, streamed: bool, budget: int | None = None) -> str:
    """A setup's name in the report: 'disaggregated' (streamed, the cluster default),
    'disaggregated-whole' (stream_migration off), 'colocated' (or 'colocated-N' for chunk budget N
    where several are compared), 'per-request'."""
    if mode == "per_request":
        return "per-request"
    if mode == "colocated" and budget is not None:
        return f"colocated-{budget}"
    return f"{mode}-whole" if mode == "disaggregated" and not streamed else mode


def placement(workers: int, cpus: list[int], pinned: bool) -> dict:
    """Where a setup's workers compute: one core each while there are enough (two on one core
    beyond), and the cores left for the coordinator and the load client (which share them, or
    every core, unpinned, when none is left)."""
    if not pinned or not cpus:
        return {"pinned": False, "cpus": cpus, "workers": workers}
    assigned = [cpus[i % len(cpus)] for i in range(workers)]
    return {"pinned": True, "cpus": cpus, "workers": workers, "worker_cpus": assigned,
            "workers_per_core": max(assigned.count(c) for c in set(assigned)),
            "shared_core": workers > len(cpus),
            "cores_left_for_coordinator_and_client": max(0, len(cpus) - workers),
            "coordinator_and_client": "unpinned (every core, shared with the workers)" if workers >= len(cpus)
            else f"unpinned; {len(cpus) - workers} core(s) no worker uses"}


# ---- workloads -------------------------------------------------------------------------------
def _workload(cfg: ServeBenchConfig, rate: float, n: int, seed: int) -> Workload:
    return preset(cfg.preset, rate, n, seed)


def trace_records(cfg: ServeBenchConfig):
    from measure.serve_trace import read_mooncake

    return read_mooncake(cfg.trace)


def time_scale(cfg: ServeBenchConfig, rate: float) -> float | None:
    """The time scale that replays the trace's first num_requests records at `rate` (None: no trace)."""
    if cfg.trace is None:
        return None
    from measure.serve_trace import scale_for_rate

    return scale_for_rate(trace_records(cfg)[:cfg.num_requests], rate)


def _requests(cfg: ServeBenchConfig, rate: float, n: int, seed: int) -> list[RequestSpec]:
    if cfg.trace is not None:
        from measure.serve_trace import scale_for_rate, to_specs

        recs = trace_records(cfg)
        if n > len(recs):
            raise ValueError(f"the trace {cfg.trace} has {len(recs)} requests, {n} asked for")
        return to_specs(recs, scale_for_rate(recs[:cfg.num_requests], rate), salt=seed, limit=n)
    if cfg.preset == "mixed":
        return mixed_requests(rate, n, seed)
    return make_requests(_workload(cfg, rate, n, seed))


def mean_output(cfg: ServeBenchConfig) -> float:
    return float(np.mean([s.max_tokens for s in _requests(cfg, 1.0, cfg.num_requests, cfg.seed + 1)]))


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
                     "migration_ms": percentiles(present(ok, "migration_ms")),
                     "tpot_ms": percentiles([t for t in map(tpot_ms, ok) if t is not None])}
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


def calibrate(overhead: dict | None, cfg: ServeBenchConfig, measured_on: str, log) -> tuple[SLO, dict]:
    """The run's SLOs from the first setup's overhead measurement (measure.serve_slo)."""
    u_ttft = u_tpot = None
    if overhead is not None:
        u_ttft = overhead["prefill_only"]["ttft_ms"]["p50"]
        u_tpot = overhead["full"]["tpot_ms"]["p50"]
    slo = serve_slo.scaled(cfg.slo_scale, cfg.slo, u_ttft, u_tpot)
    rec = serve_slo.record(cfg.slo_scale, slo, u_ttft, u_tpot, measured_on if overhead else None)
    how = lambda m, u: "fixed" if m is None else f"{m:g} x unloaded {fmt(u)} ms"  # noqa: E731
    log(f"  SLOs: TTFT {slo.ttft_ms:.0f} ms ({how(cfg.slo_scale.ttft, u_ttft)}), TPOT {slo.tpot_ms:.1f} ms "
        f"({how(cfg.slo_scale.tpot, u_tpot)}), measured on {measured_on}")
    return slo, rec


def _search_config(cfg: ServeBenchConfig, start: float) -> sg.SearchConfig:
    return sg.SearchConfig(start_rate=start, steps=cfg.search_steps, seed=cfg.seed,
                           min_rate=start / cfg.search_span, max_rate=start * cfg.search_span)


def one_run(url: str, setup: Setup, cfg: ServeBenchConfig, slo: SLO, rate: float, seed: int,
            log, streamed: bool | None) -> dict:
    """One open-loop run at `rate` from prompt seed `seed`: its summary, per-request SLO flags and paths."""
    mode = setup.mode
    specs = _requests(cfg, rate, cfg.num_requests, seed)
    kind = "" if streamed is None or mode == "colocated" else ", streamed" if streamed else ", whole"
    name = f"{setup.label}{kind} @ {rate:.3g} req/s"
    log(f"{name}: {len(specs)} requests, {cfg.trace or cfg.preset}")
    before = path_counts(url)  # per request: where each prompt was prefilled (coordinator.decide)
    records, dur, pid = _load(url, specs, cfg, _progress(log, name, len(specs)))
    run = {"mode": mode, "rate": rate, "num_requests": len(specs), "seed": seed,
           "step_budget": setup.step_budget, **summarize(records, dur, slo)}
    if cfg.trace is not None:
        run["time_scale"] = time_scale(cfg, rate)
    run["slo_met"] = [bool(r.ok and meets_slo(r, slo)) for r in records]  # per request, in send order
    after = path_counts(url)
    run["paths"] = {k: int(v - before.get(k, 0)) for k, v in after.items() if v > before.get(k, 0)}
    run["streamed"] = bool(streamed) if streamed is not None else run["streamed_migrations"] > 0
    run["label"] = setup.label if streamed is not None else label(mode, run["streamed"])
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
    return run


def bench_target(url: str, setup: Setup, cfg: ServeBenchConfig, log, streamed: bool | None = None,
                 calibration: dict | None = None) -> tuple[list[dict], dict | None, dict, dict]:
    """Warm-up, overhead (the calibration, when `calibration` is None: the first setup), then the
    goodput search (or one run per fixed rate) against the coordinator at `url`. streamed: the
    cluster's stream_migration (None: unknown, a run is labelled by whether any migration streamed).
    Returns (runs, overhead, goodput, calibration: {slo, record, start})."""
    if cfg.warmup_requests:
        _sequential(url, _requests(cfg, 1.0, cfg.warmup_requests, cfg.seed + 3000), cfg)
    overhead = measure_overhead(url, cfg, log) if cfg.overhead_requests else None
    if overhead is not None:
        overhead.update(mode=setup.mode, streamed=bool(streamed) if streamed is not None
                        else overhead["full"]["streamed_migrations"] > 0)
    if calibration is None:
        slo, rec = calibrate(overhead, cfg, setup.label, log)
        start = cfg.search_start
        if start is None:
            u_ttft, u_tpot = rec["unloaded_ttft_ms"], rec["unloaded_tpot_ms"]
            if u_ttft and u_tpot:
                start = serve_slo.start_rate(cfg.prefill + cfg.decode, u_ttft, u_tpot, mean_output(cfg))
            else:
                start = sg.SearchConfig().start_rate
        calibration = {"slo": slo, "record": rec, "start": start}
        if not cfg.rates and rec["unloaded_ttft_ms"] and rec["unloaded_tpot_ms"]:
            n_setups = len(setups(cfg)) if not cfg.url else 1
            args = (cfg.num_requests, rec["unloaded_ttft_ms"], rec["unloaded_tpot_ms"], mean_output(cfg),
                    cfg.overhead_requests)
            est = serve_slo.estimate_seconds(n_setups, [start] * cfg.search_steps, *args)
            worst = serve_slo.estimate_seconds(n_setups, serve_slo.slowest_rates(start, cfg.search_steps,
                                                                                cfg.search_span), *args)
            calibration.update(estimate_s=est, worst_case_s=worst)
            log(f"  goodput search from {start:.3g} req/s, {cfg.search_steps} steps x {cfg.num_requests} "
                f"requests per setup: about {est / 60:.0f} min in all, at most {worst / 60:.0f} "
                f"(measure.serve_slo.estimate_seconds)")
    slo = calibration["slo"]
    runs: list[dict] = []
    if cfg.rates:
        for i, rate in enumerate(cfg.rates):
            runs.append(one_run(url, setup, cfg, slo, rate, cfg.seed + 1 + i, log, streamed))
        scfg = _search_config(cfg, cfg.rates[0])
        goodput = sg.summarize_points({r["rate"]: r["slo_met"] for r in runs}, scfg,
                                      [{"rate": r["rate"], "requests": len(r["slo_met"]),
                                        "attainment": sg.attainment(r["slo_met"])} for r in runs])
    else:
        def measure(rate: float, step: int) -> list[bool]:
            runs.append(one_run(url, setup, cfg, slo, rate, cfg.seed + 1 + step, log, streamed))
            runs[-1]["search_step"] = step
            return runs[-1]["slo_met"]

        goodput = sg.search(measure, _search_config(cfg, calibration["start"]), log)
    ci = goodput["ci"]
    log(f"  goodput {goodput['goodput_req_s']:.3g} req/s (interval {fmt(ci[0], 2)}..{fmt(ci[1], 2)}; "
        f"bracket {goodput['bracket']})")
    return runs, overhead, goodput, calibration


def _detail(r: RequestRecord, t0: float) -> dict:
    d = r.to_dict()
    for k in ("send_s", "first_s", "end_s"):
        d[k] = None if d[k] is None else d[k] - t0
    d["chunk_s"] = [t - t0 for t in d["chunk_s"]]
    return d


def cluster_config(mode: str, cfg: ServeBenchConfig, streamed: bool = True, step_budget: int | None = None):
    """The ClusterConfig of one setup: the model, its weights, the chunk budget (the setup's, else
    cfg.step_budget) and, with pin_workers, one thread per worker pinned to a core of its own."""
    from coordinator.cluster import ClusterConfig

    engine: dict = {"scheduler": {"max_num_batched_tokens": step_budget or cfg.step_budget}}
    if cfg.weights or cfg.model != "tiny":  # tiny keeps the engine's own (f32) weights, as the tests
        from model_files.gguf import is_gguf_spec

        # NOTE: `pdserve up`'s CPU default (pdserve_cli.weights_arg): a GGUF model's own blocks, else bf16
        engine["weights"] = cfg.weights or ("gguf" if is_gguf_spec(cfg.model) else "bf16")
    common = {"transport": cfg.transport, "model": cfg.model, "block_size": cfg.block_size,
              "num_blocks": cfg.num_blocks, "start_timeout_s": cfg.start_timeout_s, "engine": engine}
    if cfg.pin_workers:
        common.update(torch_threads=1, pin_cpus=tuple(_cpus()))
    if cfg.step_target_s is not None:
        common["step_target_s"] = cfg.step_target_s
    if mode == "per_request" and cfg.decide_profile:
        import json

        from coordinator.decide import from_profile

        with open(cfg.decide_profile) as f:
            common.update(from_profile(json.load(f)))
    if mode in ("disaggregated", "per_request"):
        return ClusterConfig(prefill=cfg.prefill, decode=cfg.decode, stream_migration=streamed,
                             disaggregate="auto" if mode == "per_request" else "always", **common)
    return ClusterConfig(colocated=cfg.prefill + cfg.decode, stream_migration=False, **common)


def _cpus() -> list[int]:
    """The CPUs this process may run on (all of them where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _workers_info(url: str) -> list[dict]:
    """Each worker's CPUs, threads and startup timings, from the coordinator's /v1/cluster."""
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/v1/cluster", timeout=10) as r:
            info = json.loads(r.read().decode())
    except (OSError, ValueError):
        return []
    keys = ("name", "role", "cpus", "threads", "niceness", "startup", "pid")
    return [{k: w.get(k) for k in keys} for w in info.get("workers", [])]


def compare(goodput: dict[str, dict]) -> dict:
    """The best colocated chunk budget (the baseline) and every other setup against it: the ratio of
    goodputs and whether their intervals overlap (a tie)."""
    colo = {k: v for k, v in goodput.items() if k.startswith("colocated")}
    out: dict = {}
    if colo:
        best = max(colo, key=lambda k: (colo[k]["goodput_req_s"], -list(colo).index(k)))
        out["best_colocated"] = {"label": best, "goodput_req_s": colo[best]["goodput_req_s"],
                                 "ci": colo[best]["ci"]}
        base = colo[best]
        out["against_best_colocated"] = {
            k: {"ratio": v["goodput_req_s"] / base["goodput_req_s"] if base["goodput_req_s"] else None,
                "tie": sg.tie(v["ci"], base["ci"])} for k, v in goodput.items() if k not in colo}
    return out


def run_bench(cfg: ServeBenchConfig, log=print) -> dict:
    """The whole benchmark; returns the JSON report (slo, slo_scaling, config, runs, overhead and
    goodput per setup label, the best colocated budget and the comparison, placement per setup)."""
    runs: list[dict] = []
    overhead: dict = {}
    goodput: dict = {}
    where: dict = {}
    calibration = None
    note = p99_note(cfg.num_requests)
    if note:
        log(f"{'quick: ' if cfg.quick else 'NOTE: '}{note}")
    if cfg.url:
        streams = cfg.mode != "colocated"
        setup = Setup(cfg.mode, streams, cfg.step_budget, label(cfg.mode, streams))
        r, o, g, calibration = bench_target(cfg.url, setup, cfg, log)
        runs += r
        name = label(cfg.mode, o["streamed"]) if o else cfg.mode
        overhead[name], goodput[name] = o, g
        where[name] = {"workers_info": _workers_info(cfg.url)}
    else:
        from deploy.launch import ClusterServer, RayConfig, start_ray, stop_ray

        started = start_ray(RayConfig(num_cpus=2))
        try:
            for setup in setups(cfg):
                t0 = time.perf_counter()
                srv = ClusterServer(cluster_config(setup.mode, cfg, setup.streamed, setup.step_budget))
                try:
                    port = srv.start(timeout=cfg.start_timeout_s)
                    url = f"http://127.0.0.1:{port}"
                    log(f"== {setup.label} (stream_migration {'on' if setup.streamed else 'off'}, chunk "
                        f"budget {setup.step_budget}): cluster up on port {port} in "
                        f"{time.perf_counter() - t0:.1f} s ==")
                    where[setup.label] = {**placement(cfg.prefill + cfg.decode, _cpus(), cfg.pin_workers),
                                          "workers_info": _workers_info(url)}
                    r, o, g, calibration = bench_target(url, setup, cfg, log, setup.streamed, calibration)
                    runs += r
                    overhead[setup.label], goodput[setup.label] = o, g
                finally:
                    srv.stop()
        finally:
            stop_ray(started)
    from measure.machine import describe

    slo = calibration["slo"] if calibration else cfg.slo
    return {"machine": describe(bandwidth=False), "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
            "slo_scaling": calibration["record"] if calibration else None,
            "config": {"preset": None if cfg.trace else cfg.preset, "trace": cfg.trace,
                       "rates": list(cfg.rates),
                       "search": None if cfg.rates else {"steps": cfg.search_steps,
                                                          "start_rate": calibration and calibration["start"],
                                                          "requests_per_step": cfg.num_requests},
                       "estimate_s": calibration and calibration.get("estimate_s"),
                       "worst_case_s": calibration and calibration.get("worst_case_s"),
                       "search_span": cfg.search_span,
                       "num_requests": cfg.num_requests, "model": cfg.model, "weights": cfg.weights,
                       "modes": [cfg.mode] if cfg.url else list(cfg.modes), "prefill": cfg.prefill,
                       "decode": cfg.decode, "transport": cfg.transport, "seed": cfg.seed, "url": cfg.url,
                       "streamed": None if cfg.url else [s.streamed for s in setups(cfg)
                                                         if s.mode == "disaggregated"],
                       "step_budget": None if cfg.url else cfg.step_budget,
                       "colocated_budgets": None if cfg.url else list(colocated_budgets(cfg)),
                       "step_target_s": None if cfg.url else cfg.step_target_s,
                       "decide_profile": cfg.decide_profile,
                       "pin_workers": cfg.pin_workers, "cpus": _cpus(), "quick": cfg.quick,
                       "p99_note": note, "bench_pid": os.getpid(), "client": "subprocess"},
            "runs": runs, "overhead": overhead, "goodput": goodput, **compare(goodput), "placement": where}
