"""`pdserve plan --validate`: the configurations that fit this machine (colocated 2, 1P+1D, 1P+1D
with per-request decisions) served for real by `bench serve` (its functions in-process: the model
the profile measured, or --model, the same cluster settings, workers pinned one core each, the
plan's bench serve preset, mixed unless --preset, or its Mooncake trace, a short run per rate)
and simulated on the very same requests (bench serve's request specs, shared prefixes
recognised), so predicted and measured TTFT p50/p99, TPOT p50/p99 and goodput sit side by side
per configuration and rate, each prediction twice: the
model as loaded (the profile's contention unless --contention) and a what-if with the given
`contention`; the p50 errors (predicted / measured - 1) are counted against the issue's 25%. It
also reports the unloaded TTFT bench serve measures (max_tokens=1, back to back) beside the
model's prefill of the same prompts and its prefill plus serving path; and whether ranking the
configurations by total goodput gives the same order measured and predicted, and per cell the
share of prompt tokens the prefix cache gave, measured (each response's `cached_tokens`) and
simulated: the predicted TTFT of a workload with shared prefixes hangs on it. Beside the overall
TTFT p50 it compares the p50 per prompt class (`by_class`: short and long), request by request:
the mixed workload's TTFTs fall mostly in two groups, and the overall p50 lies where they meet.
A measured order counts only where the measurement can tell: per pair of configurations, a
paired bootstrap over the requests (every configuration served the same ones at a rate: the same
draws for each, their SLO flags counted over the rate's common duration) gives a 95% interval of
the goodput gap; a pair whose interval holds 0 is a tie (equal flags, a run that merely ended
later, draw 0 every time), and the ranking matches when every other pair is predicted in the
measured order. `resimulate` predicts a saved validation again with another model (the same
requests, the measured cells as they were): how a change to the model is checked against past
measurements in seconds (`pdserve plan --profile P.json --resimulate PLAN.json`).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from planner.des import SimConfig, simulate
from planner.metrics import summarize
from planner.model import StepModel
from planner.workload import from_specs

TARGET = 0.25  # the bound on |predicted / measured - 1| of TTFT p50 and TPOT p50
SETUPS = {"colocated": SimConfig(colocated=2), "disaggregated": SimConfig(prefill=1, decode=1),
          "per_request": SimConfig(prefill=1, decode=1, decide="auto")}


def _sim_config(mode: str, cfg, local_max: int) -> SimConfig:
    return replace(SETUPS[mode], step_budget=cfg.step_budget, block_size=cfg.block_size,
                   num_blocks=cfg.num_blocks, local_prefill_max_tokens=local_max)


def _ranking(totals: dict[str, float]) -> list[str]:
    return [k for k, _ in sorted(totals.items(), key=lambda kv: -round(kv[1], 1))]


def _pairs(measured: dict[str, float], predicted: dict[str, float], runs: dict | None = None,
           draws: int = 2000, seed: int = 0) -> list[dict]:
    """Every pair of configurations: the measured gap (share of the larger), whether the
    prediction orders them the same way, and, given `runs` (config -> {rate: (per-request SLO flags
    in send order, duration s)}), the gap's 95% paired-bootstrap interval and whether it excludes 0."""
    names, out = list(measured), []
    boot = _bootstrap(runs, draws, seed) if runs else None  # config -> (draws,) summed goodput
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            top = max(measured[a], measured[b], 1e-9)
            gap = (measured[a] - measured[b]) / top
            same = (measured[a] - measured[b]) * (predicted[a] - predicted[b]) > 0
            row = {"pair": [a, b], "measured_gap": gap, "same_order": bool(same)}
            if boot is not None:
                lo, hi = np.percentile((boot[a] - boot[b]) / top, [2.5, 97.5])
                row.update(gap_ci=[float(lo), float(hi)], significant=bool(lo > 0 or hi < 0))
            out.append(row)
    return out


def _bootstrap(runs: dict, draws: int, seed: int) -> dict | None:
    """Per config: `draws` resamples of its summed goodput, paired. At each rate every config served
    the same requests, so the same (n,) draws of request indices serve all of them, and each one's
    good requests are counted over the rate's common duration (the configs' mean): a gap from
    wall-clock alone (equal flags, one run ending a few ms later) is 0 in every draw. None when the
    configs did not serve the same rates and request counts (nothing to pair)."""
    rng = np.random.default_rng(seed)
    names = list(runs)
    rates = {frozenset(r) for r in runs.values()}
    if len(rates) != 1:
        return None
    out = {name: np.zeros(draws) for name in names}
    for rate in sorted(next(iter(rates))):
        cells = [runs[name][rate] for name in names]  # [(flags, duration s)]
        sizes = {len(flags) for flags, _ in cells}
        if len(sizes) != 1:
            return None
        n = sizes.pop()
        if n == 0:
            continue
        duration = max(float(np.mean([d for _, d in cells])), 1e-9)
        picks = rng.integers(0, n, size=(draws, n))  # (draws, n), shared by every config
        for name, (flags, _) in zip(names, cells):
            out[name] += np.asarray(flags, dtype=float)[picks].sum(axis=1) / duration
    return out


def ranking_matches(pairs: list[dict]) -> bool:
    """Every pair the measurement separates (its interval excludes 0) is predicted in that order."""
    return all(p["same_order"] for p in pairs if p.get("significant", True))


def _serve_config(rates, num_requests: int, slo, preset: str = "mixed", model: str = "tiny",
                  trace: str | None = None, step_budget: int = 512):
    """bench serve's settings for the validation: the plan's fixed SLOs (no scaling: the plan's own),
    one colocated setup at the plan's chunk budget, workers pinned as bench serve pins them."""
    from measure.serve import ServeBenchConfig
    from measure.serve_slo import SLOScale

    return ServeBenchConfig(modes=tuple(SETUPS), streamed=(True,), rates=tuple(rates),
                            num_requests=num_requests, preset=preset, trace=trace, model=model,
                            step_budget=step_budget, colocated_budgets=(), overhead_requests=4,
                            warmup_requests=2, slo=slo, slo_scale=SLOScale(None, None), quick=True,
                            detailed=True)


def run_validate(model: StepModel, rates, num_requests: int, slo, contention: float, log=print,
                 preset: str = "mixed", served_model: str = "tiny", trace: str | None = None,
                 step_budget: int = 512, search_steps: int | None = None,
                 predicted_goodput: dict[str, float] | None = None) -> dict:
    """Serve the configurations with bench serve (`served_model`: the model the profile measured)
    and predict the very same requests. With `search_steps`, bench serve runs its goodput search
    (that many steps per configuration, `rates[0]` the first rate) instead of one run per rate, and
    `goodput` sets each configuration's measured goodput beside `predicted_goodput` (the plan's
    sustained rate per configuration label)."""
    from measure.serve import run_bench

    cfg = _serve_config(rates, num_requests, slo, preset, served_model, trace, step_budget)
    if search_steps:
        cfg = replace(cfg, rates=(), search_steps=search_steps, search_start=min(rates), search_span=4.0)
    report = run_bench(cfg, log=log)
    measured = [{"mode": r["mode"], "rate": r["rate"], "seed": r.get("seed"), "measured": _pick(r),
                 "slo_met": r["slo_met"],
                 "duration": r["duration"], "measured_paths": r.get("paths", {}),
                 "requests": _per_request(r.get("requests"))} for r in report["runs"]]
    unloaded = {name: {"measured_ttft_p50": o["prefill_only"]["ttft_ms"]["p50"]}
                for name, o in report["overhead"].items() if o}
    out = {**compare(model, cfg, measured, unloaded, contention), "serve_config": report["config"],
           "slo": report["slo"]}
    if search_steps:
        out["goodput"] = goodput_against(report["goodput"], predicted_goodput or {})
    return out


# bench serve's setup labels (one colocated budget) -> the planner's configuration labels
SERVE_LABELS = {"colocated": "colocated 2", "disaggregated": "1P+1D", "per-request": "1P+1D auto"}


def goodput_against(measured: dict[str, dict], predicted: dict[str, float]) -> dict:
    """Per configuration: bench serve's goodput search (goodput, interval) beside the plan's predicted
    sustained rate, the error (predicted / measured - 1) and whether it is within TARGET; and the
    picks: the plan's best, the measured best and the configurations tied with it (their intervals
    overlap), and whether the plan's pick is among those."""
    from measure.serve_goodput import tie

    rows = {}
    for lbl, g in measured.items():
        config = SERVE_LABELS.get(lbl, lbl)
        pred, meas = predicted.get(config), g["goodput_req_s"]
        err = None if pred is None or not meas else pred / meas - 1
        rows[config] = {"measured": meas, "ci": g["ci"], "predicted": pred, "error": err,
                        "within_target": err is not None and abs(err) <= TARGET}
    if not rows:
        return {"configs": rows}
    best = max(rows, key=lambda k: rows[k]["measured"])
    tied = [k for k in rows if tie(rows[k]["ci"], rows[best]["ci"])]
    known = {k: v["predicted"] for k, v in rows.items() if v["predicted"] is not None}
    pick = max(known, key=known.get) if known else None
    return {"configs": rows, "measured_best": best, "measured_tied_with_best": tied, "predicted_best": pick,
            "pick_matches": pick in tied if pick else None}


def resimulate(model: StepModel, saved: dict, contention: float) -> dict:
    """A saved validation (`plan --validate --json`'s "validate") predicted again by `model`: the
    same requests (rebuilt from the serve config's seed), the measured cells as they were. Rows
    saved before they kept their per-request SLO flags rank without the bootstrap."""
    from measure.serve_metrics import SLO

    sc = saved["serve_config"]
    slo = SLO(**{k: v for k, v in saved["slo"].items() if k in SLO.__dataclass_fields__})
    cfg = _serve_config(sc["rates"], sc["num_requests"], slo, sc.get("preset") or "mixed",
                        sc.get("model", "tiny"), sc.get("trace"), sc.get("step_budget") or 512)
    measured = [{k: r.get(k) for k in ("mode", "rate", "seed", "measured", "slo_met", "duration",
                                       "measured_paths", "requests")}
                for r in saved["rows"]]
    unloaded = {n: {"measured_ttft_p50": u["measured_ttft_p50"]} for n, u in saved["unloaded"].items()}
    return {**compare(model, cfg, measured, unloaded, contention), "serve_config": sc, "slo": saved["slo"]}


def compare(model: StepModel, cfg, measured: list[dict], unloaded: dict, contention: float) -> dict:
    """The model (and its what-if `contention`) on the very requests each measured cell served."""
    from coordinator.config import ClusterConfig
    from measure.serve import _requests

    local_max = ClusterConfig.__dataclass_fields__["local_prefill_max_tokens"].default
    rows, measured_total, predicted_total, runs = [], {}, {}, {}
    for run in measured:
        mode, rate = run["mode"], run["rate"]
        seed = run.get("seed")  # saved before runs kept their seed: the rate's index, as bench serve drew it
        seed = cfg.seed + 1 + list(cfg.rates).index(rate) if seed is None else seed
        reqs = from_specs(_requests(cfg, rate, cfg.num_requests, seed))
        sc = _sim_config(mode, cfg, local_max)
        outcomes = simulate(reqs, model, sc)
        pred = summarize(outcomes, cfg.slo)
        shared = summarize(simulate(reqs, replace(model, contention=contention), sc), cfg.slo)
        m = run["measured"]
        rows.append({"config": sc.label, "mode": mode, "rate": rate, "seed": seed, "measured": m,
                     "predicted": _pick(pred), "predicted_contention": _pick(shared),
                     "error": {k: _err(_pick(pred)[k], m[k]) for k in ("ttft_p50", "tpot_p50")},
                     "requests": run.get("requests"),
                     "by_class": by_class(run.get("requests"), outcomes, local_max),
                     "measured_paths": run.get("measured_paths") or {}, "predicted_paths": pred["paths"],
                     "slo_met": run.get("slo_met"), "duration": run.get("duration")})
        measured_total[sc.label] = measured_total.get(sc.label, 0.0) + m["goodput"]
        if run.get("slo_met") is not None:
            runs.setdefault(sc.label, {})[rate] = (run["slo_met"], run["duration"])
        predicted_total[sc.label] = predicted_total.get(sc.label, 0.0) + pred["goodput_req_s"]
    m_rank, p_rank = _ranking(measured_total), _ranking(predicted_total)
    pairs = _pairs(measured_total, predicted_total, runs if len(runs) == len(measured_total) else None)
    tied = not any(p.get("significant", True) for p in pairs)  # NOTE: then the order is noise, not a ranking
    within = {k: sum(abs(r["error"][k]) <= TARGET for r in rows if r["error"][k] is not None)
              for k in ("ttft_p50", "tpot_p50")}
    classes = [c for r in rows for c in (r["by_class"] or {}).values() if c["error"] is not None]
    if classes:
        within.update(ttft_p50_by_class=sum(abs(c["error"]) <= TARGET for c in classes),
                      of_classes=len(classes))
    return {"rows": rows, "unloaded": _unloaded(unloaded, model, cfg), "contention": contention,
            "model_contention": model.contention, "within_25pct": {**within, "of": len(rows)},
            "ranking": {"measured": m_rank, "predicted": p_rank, "match": ranking_matches(pairs),
                        "same_order": m_rank == p_rank, "measured_tied": tied, "pairs": pairs,
                        "measured_goodput_sum": measured_total, "predicted_goodput_sum": predicted_total}}


def _per_request(records: list[dict] | None) -> list[list] | None:
    """bench serve's detailed records -> [prompt tokens, cached tokens, TTFT ms or None, the
    server's own TTFT ms or None (its response's `pdserve.ttft_ms`: from the coordinator's receipt
    to its first token out, so the rest is the client's and the loopback's), the worker that
    prefilled it or None] in spec order."""
    if records is None:
        return None
    return [[r["prompt_tokens"], r.get("cached_tokens"),
             None if r["first_s"] is None else (r["first_s"] - r["send_s"]) * 1e3, r.get("server_ttft_ms"),
             r.get("worker")] for r in records]


def by_class(requests: list[list] | None, outcomes: list, short_max: int) -> dict | None:
    """TTFT p50 measured and predicted per prompt class, on the same requests: "short" (at most
    `short_max` prompt tokens computed, the per-request decision's threshold) and "long". A mixed
    workload's TTFTs fall mostly in two groups, so the overall p50 lands where they meet and
    moves with the few requests between them; per class it does not. A request's class
    is what it computed as measured (its response's cached_tokens), the same for both sides.
    `paired_ms`: the median over the class's requests of predicted minus measured TTFT, request by
    request (near 0 when the model follows each request and only a few slow ones move the p50)."""
    if not requests:
        return None
    out = {}
    for name, keep in (("short", lambda n: n <= short_max), ("long", lambda n: n > short_max)):
        pairs = [(q[2], (o.first_s - o.req.arrival_s) * 1e3) for q, o in zip(requests, outcomes)
                 if q[2] is not None and o.first_s is not None and keep(q[0] - (q[1] or 0))]
        if pairs:
            m, p = (float(np.median([x[i] for x in pairs])) for i in (0, 1))
            out[name] = {"n": len(pairs), "measured_p50": m, "predicted_p50": p, "error": _err(p, m),
                         "paired_ms": float(np.median([b - a for a, b in pairs]))}
    return out


def _err(pred, meas) -> float | None:
    return None if pred is None or not meas else pred / meas - 1.0


def _pick(s: dict) -> dict:
    return {"ttft_p50": s["ttft_ms"]["p50"], "ttft_p99": s["ttft_ms"]["p99"], "tpot_p50": s["tpot_ms"]["p50"],
            "tpot_p99": s["tpot_ms"]["p99"], "goodput": s["goodput_req_s"],
            "prefix_hit_share": s.get("prefix_hit_share"),
            "server_ttft_p50": (s.get("server_ttft_ms") or {}).get("p50")}  # measured: the coordinator's view


def _unloaded(measured: dict, model: StepModel, cfg) -> dict:
    """Per setup: measured TTFT p50 of max_tokens=1 requests one at a time vs the model's prefill."""
    from measure.serve import _requests

    reqs = from_specs(_requests(cfg, 1.0, cfg.overhead_requests, cfg.seed + 1000))  # measure_overhead's
    pred = [model.prefill_ms(r.prompt_tokens) for r in reqs]
    warm = [p + model.colocated.ttft_ms(r.prompt_tokens, r.prompt_tokens, 0.0) for p, r in zip(pred, reqs)]
    # NOTE: max_tokens=1 never migrates: the colocated serving path, back to back (warm)
    return {name: {"measured_ttft_p50": u["measured_ttft_p50"], "model_prefill_p50": float(np.median(pred)),
                   "model_ttft_p50": float(np.median(warm))} for name, u in measured.items()}


def _f(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def _share(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _pct(e) -> str:
    return "-" if e is None else f"{100 * e:+.0f}%"


def format_validate(v: dict) -> str:
    c, mc = v["contention"], v.get("model_contention", 0.0)
    lines = [f"cells: measured / predicted (contention {mc:g}) / predicted (contention {c:g}); "
             "err: predicted / measured - 1; prefix hits: the share of prompt tokens the prefix cache "
             "gave, measured / predicted",
             "| config | rate | TTFT p50 | err | TTFT p99 | TPOT p50 | err | TPOT p99 | goodput "
             "| prefix hits |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in v["rows"]:
        m, a, s = r["measured"], r["predicted"], r["predicted_contention"]
        cells = {k: " / ".join((_f(m[k]), _f(a[k]), _f(s[k]))) for k in
                 ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")}
        e = r.get("error") or {}
        good = f"{m['goodput']:.2f} / {a['goodput']:.2f} / {s['goodput']:.2f}"
        hits = " / ".join(_share(x.get("prefix_hit_share")) for x in (m, a))  # saved before: "-"
        lines.append(f"| {r['config']} | {r['rate']:g} | {cells['ttft_p50']} | {_pct(e.get('ttft_p50'))} | "
                     f"{cells['ttft_p99']} | {cells['tpot_p50']} | {_pct(e.get('tpot_p50'))} | "
                     f"{cells['tpot_p99']} | {good} | {hits} |")
    w = v.get("within_25pct")
    if w:
        lines.append(f"within {TARGET:.0%}: TTFT p50 {w['ttft_p50']}/{w['of']}, "
                     f"TPOT p50 {w['tpot_p50']}/{w['of']}"
                     + (f"; TTFT p50 per prompt class {w['ttft_p50_by_class']}/{w['of_classes']}"
                        if "of_classes" in w else ""))
    for r in v["rows"]:
        cls = r.get("by_class") or {}
        if cls:
            each = "; ".join(f"{k} ({c['n']}) {_f(c['measured_p50'])} / {_f(c['predicted_p50'])} "
                             f"{_pct(c['error'])}, paired {c['paired_ms']:+.1f} ms" for k, c in cls.items()
                             if "paired_ms" in c)
            lines.append(f"  {r['config']} @ {r['rate']:g}: TTFT p50 measured / predicted per class: {each}")
    for name, u in v["unloaded"].items():
        lines.append(f"unloaded TTFT ({name}, max_tokens=1, back to back): measured p50 "
                     f"{_f(u['measured_ttft_p50'])} ms, model prefill p50 {_f(u['model_prefill_p50'])} ms, "
                     f"+ serving path {_f(u.get('model_ttft_p50'))} ms")
    g = v.get("goodput")
    if g and g["configs"]:
        lines.append("goodput search (req/s at >= 90% within both SLOs): measured [interval] / predicted, "
                     "err")
        for name, c in g["configs"].items():
            hi = "open" if c["ci"][1] is None else f"{c['ci'][1]:.2f}"
            pred = "-" if c["predicted"] is None else f"{c['predicted']:.2f}"
            lines.append(f"  {name}: {c['measured']:.2f} [{c['ci'][0]:.2f}..{hi}] / {pred}, "
                         f"{_pct(c['error'])}")
        lines.append(f"  pick: predicted {g['predicted_best']}, measured {g['measured_best']} (tied with it: "
                     f"{', '.join(g['measured_tied_with_best'])}): "
                     f"{'match' if g['pick_matches'] else 'DIFFERENT'}")
    rk = v["ranking"]
    lines.append(f"ranking by goodput: measured {rk['measured']}, predicted {rk['predicted']}: "
                 f"{'match' if rk['match'] else 'DIFFERENT'} on the pairs the measurement separates"
                 + (" (none: every gap's interval holds 0, the order says nothing)"
                    if rk["measured_tied"] else ""))
    for pr in rk.get("pairs", []):
        ci = pr.get("gap_ci")
        sep = "" if ci is None else (f" (95% {100 * ci[0]:+.1f}..{100 * ci[1]:+.1f}%: "
                                     f"{'separated' if pr['significant'] else 'a tie'})")
        lines.append(f"  {pr['pair'][0]} vs {pr['pair'][1]}: measured gap "
                     f"{100 * pr['measured_gap']:+.1f}%{sep}, "
                     f"predicted {'same order' if pr['same_order'] else 'the other order'}")
    return "\n".join(lines)
