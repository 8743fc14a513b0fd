"""`pdserve plan --validate`: the configurations that fit this machine (colocated 2, 1P+1D, 1P+1D
with per-request decisions) served for real by `bench serve` (its functions in-process: the tiny
model, the same cluster settings, a short run per rate) and simulated on the very same requests
(bench serve's request specs, shared prefixes recognised), so predicted and measured TTFT p50/p99,
TPOT p50/p99 and goodput sit side by side per configuration and rate, each prediction twice:
with no contention (the profile alone) and with the given `contention`. It also reports the
unloaded TTFT bench serve measures (max_tokens=1, one request at a time) beside the model's
prefill of the same prompts: the serving path's fixed cost, which no profile row contains; and
whether ranking the configurations by total goodput gives the same order measured and predicted.
"""

from __future__ import annotations

from dataclasses import replace

from bench.plan.des import SimConfig, simulate
from bench.plan.metrics import summarize
from bench.plan.model import StepModel
from bench.plan.workload import from_specs

SETUPS = {"colocated": SimConfig(colocated=2), "disaggregated": SimConfig(prefill=1, decode=1),
          "per_request": SimConfig(prefill=1, decode=1, decide="auto")}


def _sim_config(mode: str, cfg, local_max: int) -> SimConfig:
    return replace(SETUPS[mode], step_budget=cfg.step_budget, block_size=cfg.block_size,
                   num_blocks=cfg.num_blocks, local_prefill_max_tokens=local_max)


def _ranking(totals: dict[str, float]) -> list[str]:
    return [k for k, _ in sorted(totals.items(), key=lambda kv: -round(kv[1], 1))]


def run_validate(model: StepModel, rates, num_requests: int, slo, contention: float, log=print) -> dict:
    from bench.serve import ServeBenchConfig, _requests, run_bench
    from coordinator.config import ClusterConfig

    local_max = ClusterConfig.__dataclass_fields__["local_prefill_max_tokens"].default
    cfg = ServeBenchConfig(modes=tuple(SETUPS), streamed=(True,), rates=tuple(rates),
                           num_requests=num_requests, preset="mixed", overhead_requests=4, warmup_requests=2,
                           slo=slo, quick=True)
    report = run_bench(cfg, log=log)
    rows, measured_total, predicted_total = [], {}, {}
    for run in report["runs"]:
        mode, rate = run["mode"], run["rate"]
        i = list(cfg.rates).index(rate)
        reqs = from_specs(_requests(cfg, rate, cfg.num_requests, cfg.seed + 1 + i))
        sc = _sim_config(mode, cfg, local_max)
        alone = summarize(simulate(reqs, replace(model, contention=0.0), sc), slo)
        shared = summarize(simulate(reqs, replace(model, contention=contention), sc), slo)
        rows.append({"config": sc.label, "mode": mode, "rate": rate, "measured": _pick(run),
                     "predicted": _pick(alone), "predicted_contention": _pick(shared),
                     "measured_paths": run.get("paths", {}), "predicted_paths": alone["paths"]})
        measured_total[sc.label] = measured_total.get(sc.label, 0.0) + run["goodput_req_s"]
        predicted_total[sc.label] = predicted_total.get(sc.label, 0.0) + shared["goodput_req_s"]
    unloaded = _unloaded(report, model, cfg)
    m_rank, p_rank = _ranking(measured_total), _ranking(predicted_total)
    vals = list(measured_total.values())
    tied = max(vals) - min(vals) < 0.02 * max(vals)  # NOTE: then the order is noise, not a ranking
    return {"rows": rows, "unloaded": unloaded, "contention": contention,
            "ranking": {"measured": m_rank, "predicted": p_rank, "match": m_rank == p_rank,
                        "measured_tied": tied,
                        "measured_goodput_sum": measured_total, "predicted_goodput_sum": predicted_total},
            "serve_config": report["config"], "slo": report["slo"]}


def _pick(s: dict) -> dict:
    return {"ttft_p50": s["ttft_ms"]["p50"], "ttft_p99": s["ttft_ms"]["p99"], "tpot_p50": s["tpot_ms"]["p50"],
            "tpot_p99": s["tpot_ms"]["p99"], "goodput": s["goodput_req_s"]}


def _unloaded(report: dict, model: StepModel, cfg) -> dict:
    """Per setup: measured TTFT p50 of max_tokens=1 requests one at a time vs the model's prefill."""
    from bench.serve import _requests

    reqs = from_specs(_requests(cfg, 1.0, cfg.overhead_requests, cfg.seed + 1000))  # measure_overhead's
    pred = sorted(model.prefill_ms(r.prompt_tokens) for r in reqs)
    out = {}
    for name, o in report["overhead"].items():
        if o:
            out[name] = {"measured_ttft_p50": o["prefill_only"]["ttft_ms"]["p50"],
                         "model_prefill_p50": pred[len(pred) // 2]}
    return out


def _f(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def format_validate(v: dict) -> str:
    c = v["contention"]
    lines = [f"| config | rate | TTFT p50 meas / pred / pred c={c:g} | TTFT p99 | TPOT p50 | TPOT p99 | "
             "goodput |", "|---|---|---|---|---|---|---|"]
    for r in v["rows"]:
        m, a, s = r["measured"], r["predicted"], r["predicted_contention"]
        cells = [" / ".join((_f(m[k]), _f(a[k]), _f(s[k]))) for k in
                 ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")]
        good = f"{m['goodput']:.2f} / {a['goodput']:.2f} / {s['goodput']:.2f}"
        lines.append(f"| {r['config']} | {r['rate']:g} | " + " | ".join(cells) + f" | {good} |")
    for name, u in v["unloaded"].items():
        lines.append(f"unloaded TTFT ({name}, max_tokens=1, one at a time): measured p50 "
                     f"{_f(u['measured_ttft_p50'])} ms, model prefill p50 {_f(u['model_prefill_p50'])} ms")
    rk = v["ranking"]
    lines.append(f"ranking by goodput: measured {rk['measured']}, predicted {rk['predicted']}: "
                 f"{'match' if rk['match'] else 'DIFFERENT'}"
                 + (" (measured totals within 2%: a tie, the order says nothing)"
                    if rk["measured_tied"] else ""))
    return "\n".join(lines)
