"""`pdserve profile`'s serving part: what the engine alone does not show, on real clusters
(`deploy.launch.ClusterServer`, bench serve's settings: the profile's model, workers pinned one
core each, colocated 2 and 1P+1D streamed).
Per kind, fresh prompts at several lengths, and again sharing a planted prefix (`shapes`), in three
phases: prefill-only back to back (then the workers' own step fits, from /v1/cluster: the engine
inside a worker), full requests back to back, and full requests alone after planned idle gaps
(`isolated`). Per full request: TTFT minus the engine model's prefill of its computed tokens (the
first token leaves the prefill worker before the KV), the idle time before it, TPOT minus the
modelled batch-1 step (and, disaggregated, the migration spread over its intervals); fitted by
planner.serving.fit_ttft (`fit`: the terms the planner applies), token_ms the median TPOT
residual; beside them the raw rows, the client's share of TTFT (minus the coordinator's
`pdserve.ttft_ms`) and this process's CPU per request (the coordinator runs here), alone and under
Poisson load; colocated, the contention of two workers streaming at once (`served_contention`, what
the planner applies), beside the engines' own (planner.profile_contention's). Bounded: timeouts everywhere,
clusters and Ray always stopped.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import urllib.request

import numpy as np

from measure.serve_report import fmt
from planner.serving import ServingPath, fit_ttft

KINDS = {"colocated": "colocated", "disaggregated": "disaggregated"}  # kind -> bench serve mode


OWN = 16  # a shared-prefix request's own tokens after the prefix


def shapes(lens, block_size: int) -> list[tuple[int, int]]:
    """(prompt tokens, cached tokens) measured: every length fresh, and every length of 4 blocks or
    more again as a shared prefix (the full blocks of all but its last OWN tokens cached)."""
    return [(n, 0) for n in lens] + [(n, (n - OWN) // block_size * block_size) for n in lens
                                     if n >= 4 * block_size]


def _spec(rng, index: int, arrival_s: float, shape: tuple[int, int], max_tokens: int, base: list[int]):
    from measure.loadgen import PROMPT_ID_RANGE, RequestSpec

    (n, cached), (lo, hi) = shape, PROMPT_ID_RANGE
    head = base[:n - OWN] if cached else []
    return RequestSpec(index, arrival_s, head + [int(x) for x in rng.integers(lo, hi, size=n - len(head))],
                       max_tokens)


def back_to_back(shapes_, max_tokens: int, repeats: int, rng, start: int,
                 base: list[int]) -> tuple[list, dict[int, int]]:
    """Sequential requests; returns the specs and the cached tokens per index."""
    order = [s for s in shapes_ for _ in range(repeats)]
    specs = [_spec(rng, start + i, 0.0, s, max_tokens, base) for i, s in enumerate(order)]
    return specs, {start + i: s[1] for i, s in enumerate(order)}


def isolated(shapes_, gaps_ms, repeats: int, max_tokens: int, rng, start: int, run_s: dict[int, float],
             base: list[int]) -> tuple[list, dict[int, float], dict[int, int]]:
    """One request at a time, open loop: each sent a planned gap after the previous one's expected
    end (`run_s`: seconds a request of that length takes, measured back to back, with a margin),
    so the gap is idle time; returns the specs, the planned gap and the cached tokens per index."""
    cells = [(s, g) for _ in range(repeats) for g in gaps_ms for s in shapes_]
    specs, gaps, cached, t = [], {}, {}, 0.0
    for i, k in enumerate(rng.permutation(len(cells))):
        s, g = cells[k]
        t += g / 1e3
        specs.append(_spec(rng, start + i, t, s, max_tokens, base))
        gaps[start + i], cached[start + i] = float(g), s[1]
        t += run_s[s[0]]  # NOTE: an estimate: the idle time is measured, an overlapped request dropped
    return specs, gaps, cached


def _run_s(records) -> dict[int, float]:
    """Per prompt length: 1.25 x the median send-to-end seconds, + 3 ms."""
    by: dict[int, list[float]] = {}
    for r in records:
        if r.ok and r.end_s is not None:
            by.setdefault(r.prompt_tokens, []).append(r.end_s - r.send_s)
    return {n: 1.25 * statistics.median(v) + 0.003 for n, v in by.items()}


def _idle(records) -> dict[int, float]:
    """Per request: ms from the last answer's end to its send (negative: it overlapped one)."""
    out, last = {}, None
    for r in sorted(records, key=lambda r: r.send_s):
        out[r.index] = 1e6 if last is None else (r.send_s - last) * 1e3
        if r.end_s is not None:
            last = r.end_s if last is None else max(last, r.end_s)
    return out


def _rows(records, model, kind: str, gaps: dict[int, float], idle: dict[int, float],
          cached: dict[int, int]) -> list[dict]:
    rows = []
    for r in records:
        if not r.ok or r.first_s is None:
            continue
        ttft, computed = (r.first_s - r.send_s) * 1e3, r.prompt_tokens - cached.get(r.index, 0)
        pred = model.prefill_ms(computed)  # the first token leaves the prefill worker before the KV
        row = {"tokens": r.prompt_tokens, "computed": computed, "max_tokens": r.max_tokens,
               "gap_ms": gaps.get(r.index, 0.0),
               "idle_ms": idle[r.index], "ttft_ms": ttft, "resid_ms": ttft - pred,
               "client_ms": None if r.server_ttft_ms is None else ttft - r.server_ttft_ms}
        if r.output_tokens > 1 and r.end_s is not None:  # disaggregated: the migration comes first
            tpot = (r.end_s - r.first_s) * 1e3 / (r.output_tokens - 1)
            mig = model.migration_ms(computed) if kind == "disaggregated" else 0.0
            step = model.step_ms(1, r.prompt_tokens + r.output_tokens // 2, 0) + mig / (r.output_tokens - 1)
            row.update(tpot_ms=tpot, token_resid_ms=tpot - step)
        rows.append(row)
    return rows


def _median(rows: list[dict], key: str, **match) -> float | None:
    xs = [r[key] for r in rows if r.get(key) is not None and all(r[k] == v for k, v in match.items())]
    return float(statistics.median(xs)) if xs else None


def _worker_steps(url: str, model, lens, step_budget: int) -> list[dict]:
    """The prefilling workers' own step fits (engine.step_pacer, via /v1/cluster) after the
    prefill-only phase, and what they make of each length (in chunks of the step budget) against
    the engine model's prefill."""
    with urllib.request.urlopen(f"{url}/v1/cluster", timeout=10) as r:
        workers = json.loads(r.read())["workers"]
    out = []
    for w in workers:
        if w.get("role") in ("colocated", "prefill") and w.get("step_fixed_ms") is not None:
            fixed, per = float(w["step_fixed_ms"]), float(w["step_us_per_token"]) / 1e3
            out.append({"name": w["name"], "step_fixed_ms": fixed, "step_ms_per_token": per,
                        "ratio_to_model": {str(n): (fixed * -(-n // step_budget) + per * n)
                                           / model.prefill_ms(n) for n in lens}})
    return out


STREAM_TOKENS, STREAM_PROMPT = 200, 128  # the served contention's streams: tokens each, prompt tokens
STREAM_OFFSET_S = 0.03  # the second stream's start after the first's: its worker has reported the first


def _tpot_ms(r) -> float | None:
    """measure.serve_metrics.tpot_ms of a request that finished, else None."""
    from measure.serve_metrics import tpot_ms

    return tpot_ms(r) if r.ok and r.first_s is not None and r.end_s is not None else None


def served_contention(url: str, rng, repeats: int) -> dict:
    """The contention engines meet when they serve: a colocated cluster's two workers each streaming one
    request (STREAM_TOKENS tokens of a STREAM_PROMPT-token prompt, the second sent STREAM_OFFSET_S
    after the first, so least-loaded routing sends it to the other worker) against one stream alone,
    alternated `repeats` times; per pair the mean TPOT of the two over the lone one's, and
    `contention` the median of those ratios minus 1 (at least 0). Beside the two engines, the
    coordinator and the load client relay both streams' tokens on the same cores, which the
    engine-only measurement (planner.profile_contention) leaves out: on the Intel machine it measured
    0.00-0.04 where this measured 0.46-0.78 (eight profiles). A pair that landed on one worker (a
    batch of two, not contention) is left out and counted in `same_worker`."""
    from measure.loadgen import PROMPT_ID_RANGE, RequestSpec
    from measure.serve_client import load_in_subprocess

    def spec(i: int, at: float) -> RequestSpec:
        return RequestSpec(i, at, [int(x) for x in rng.integers(*PROMPT_ID_RANGE, size=STREAM_PROMPT)],
                           STREAM_TOKENS)

    pairs = []
    for k in range(repeats):
        [one] = load_in_subprocess(url, [spec(5000 + 3 * k, 0.0)], 60.0)[0]
        two = load_in_subprocess(url, [spec(5001 + 3 * k, 0.0), spec(5002 + 3 * k, STREAM_OFFSET_S)], 60.0)[0]
        pairs.append((one, two))
    return contention_of(pairs)


def contention_of(pairs) -> dict:
    """served_contention's result from its (one stream's record, the two streams' records) pairs."""
    alone, together, ratios, same = [], [], [], 0
    for one, two in pairs:
        a, t = _tpot_ms(one), [_tpot_ms(r) for r in two]
        if a is None or None in t:
            continue
        if two[0].worker is not None and two[0].worker == two[1].worker:
            same += 1
            continue
        alone.append(a)
        together.append(statistics.mean(t))
        ratios.append(together[-1] / a)
    med = float(statistics.median(ratios)) if ratios else None
    return {"stream_tokens": STREAM_TOKENS, "prompt_tokens": STREAM_PROMPT, "alone_tpot_ms": alone,
            "together_tpot_ms": together, "ratios": ratios, "same_worker": same,
            "contention": None if med is None else max(0.0, med - 1.0)}


def _run_kind(url: str, cfg, model, kind: str, seed: int, step_budget: int) -> dict:
    from measure.loadgen import PROMPT_ID_RANGE, RequestSpec
    from measure.serve_client import load_in_subprocess

    rng, lens, n_tok = np.random.default_rng(seed), cfg.serving_prompt_lens, cfg.serving_max_tokens
    fresh, both = [(n, 0) for n in lens], shapes(lens, cfg.block_size)
    base = [int(x) for x in rng.integers(*PROMPT_ID_RANGE, size=max(lens))]  # the shared prefixes' source
    warm = back_to_back([(32, 0), (256, 0)], 4, 2, rng, 0, base)[0] + [RequestSpec(10, 0.0, base, 2)]
    load_in_subprocess(url, warm, 60.0, sequential=True)  # warm-up; plants `base` (migrated: both caches)
    only = load_in_subprocess(url, back_to_back(fresh, 1, cfg.serving_repeats, rng, 100, base)[0], 60.0,
                              sequential=True)[0]
    steps = _worker_steps(url, model, lens, step_budget)
    cpu0, wall0 = sum(os.times()[:2]), time.monotonic()
    specs, cached = back_to_back(both, n_tok, cfg.serving_repeats, rng, 1000, base)
    full = load_in_subprocess(url, specs, 60.0, sequential=True)[0]
    run_s = {n: 0.2 for n in lens} | _run_s(full)
    specs, gaps, more = isolated(both, cfg.serving_gaps_ms, cfg.serving_isolated_repeats, n_tok, rng, 2000,
                                 run_s, base)
    alone = load_in_subprocess(url, specs, 60.0)[0]
    cpu, wall = sum(os.times()[:2]) - cpu0, time.monotonic() - wall0
    loaded = _loaded(url, cfg, rng, n_tok)
    served = served_contention(url, rng, cfg.serving_contention_repeats) if kind == "colocated" else None
    idle = _idle(only + full + alone)
    rows = _rows(full + alone, model, kind, gaps, idle, cached | more)
    fit = fit_ttft([r for r in rows if r["idle_ms"] >= 0])  # an overlapped request queued: not a cost
    fit["token_ms"] = _median(rows, "token_resid_ms") or 0.0
    only_rows = _rows(only, model, kind, {}, idle, {})
    return {"rows": rows, "prefill_only_rows": only_rows, "failed": len(only) + len(full) + len(alone)
            - len(rows) - len(only_rows), "fit": fit, "worker_steps": steps,
            "request_overhead_ms": _median([r for r in rows if r["computed"] == r["tokens"]], "resid_ms",
                                           gap_ms=0.0),  # back to back, fresh: the older constant
            "prefill_only_overhead_ms": _median(only_rows, "resid_ms"), "token_overhead_ms": fit["token_ms"],
            "client_ms_p50": _median(rows, "client_ms"),
            "process_cpu_ms_per_request": cpu * 1e3 / max(1, len(full) + len(alone)), "phase_wall_s": wall,
            "loaded": loaded, **({"served_contention": served} if served else {})}


def _loaded(url: str, cfg, rng, n_tok: int) -> dict:
    """The serving processes' CPU per request under load: Poisson arrivals at
    `cfg.serving_loaded_rate`, fresh prompts of the serving lengths in turn; this process (the
    coordinator) and the load client's child process, over the requests sent. Sequential requests
    overstate it: under load the per-step work (reports, polls) is shared by the batch."""
    from measure.loadgen import PROMPT_ID_RANGE, RequestSpec
    from measure.serve_client import load_in_subprocess

    n, lens = cfg.serving_loaded_requests, cfg.serving_prompt_lens
    arrivals = np.cumsum(rng.exponential(1.0 / cfg.serving_loaded_rate, size=n))
    prompts = [[int(x) for x in rng.integers(*PROMPT_ID_RANGE, size=lens[i % len(lens)])] for i in range(n)]
    specs = [RequestSpec(3000 + i, float(t), prompts[i], n_tok) for i, t in enumerate(arrivals)]
    own0, kids0 = sum(os.times()[:2]), sum(os.times()[2:4])
    records, duration, _ = load_in_subprocess(url, specs, 60.0)
    own, kids = sum(os.times()[:2]) - own0, sum(os.times()[2:4]) - kids0
    ok = sum(r.ok for r in records)
    return {"rate": cfg.serving_loaded_rate, "requests": n, "ok": ok, "duration_s": duration,
            "coordinator_cpu_ms_per_request": own * 1e3 / max(1, n),
            "client_cpu_ms_per_request": kids * 1e3 / max(1, n),
            "cpu_ms_per_request": (own + kids) * 1e3 / max(1, n)}


def measure_serving(cfg, model, log=print) -> dict:
    """Per kind: rows, the fitted serving path and diagnostics (see the module doc). `model`: the
    engine-only planner StepModel of this profile."""
    from deploy.launch import ClusterServer, RayConfig, start_ray, stop_ray
    from measure.serve import ServeBenchConfig, cluster_config

    scfg = ServeBenchConfig(prefill=1, decode=1, block_size=cfg.block_size, num_blocks=1024, quick=True,
                            model=cfg.model, weights=getattr(cfg, "weights", None))
    out: dict = {"prompt_lens": list(cfg.serving_prompt_lens), "max_tokens": cfg.serving_max_tokens,
                 "repeats": cfg.serving_repeats, "gaps_ms": list(cfg.serving_gaps_ms),
                 "isolated_repeats": cfg.serving_isolated_repeats}
    started = start_ray(RayConfig(num_cpus=2))
    try:
        for i, (kind, mode) in enumerate(KINDS.items()):
            srv = ClusterServer(cluster_config(mode, scfg, streamed=True))
            try:
                url = f"http://127.0.0.1:{srv.start(timeout=scfg.start_timeout_s)}"
                out[kind] = o = _run_kind(url, cfg, model, kind, 11 + i, scfg.step_budget)
            finally:
                srv.stop()
            f = o["fit"]
            path = ServingPath(**{k: f.get(k, 0.0) for k in ServingPath.__dataclass_fields__})
            log(f"  serving {kind}: {path.describe()} (rms {fmt(f['rms_ms'], 2)} ms; client share "
                f"{fmt(o['client_ms_p50'], 2)} ms; worker engine x{fmt(_ratio(o), 2)} the model; "
                f"{o['failed']} failed); CPU per request at {o['loaded']['rate']:g} req/s: coordinator "
                f"{o['loaded']['coordinator_cpu_ms_per_request']:.1f} ms, client "
                f"{o['loaded']['client_cpu_ms_per_request']:.1f} ms (sequential: coordinator "
                f"{o['process_cpu_ms_per_request']:.1f})")
            sc = o.get("served_contention")
            if sc:
                c = sc["contention"]
                log(f"  served contention: two workers streaming at once {fmt(c, 2)} (TPOT per pair "
                    f"{[round(r, 2) for r in sc['ratios']]}x one alone; {sc['same_worker']} on one worker)")
    finally:
        stop_ray(started)
    return out


def _ratio(o: dict) -> float | None:
    xs = [x for w in o["worker_steps"] for x in w["ratio_to_model"].values()]
    return float(statistics.median(xs)) if xs else None
