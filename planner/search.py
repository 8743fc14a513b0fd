"""The search: every configuration of a worker budget (colocated K; P prefill + D decode for every
split, each with coordinator.decide 'always' and 'auto'), simulated at every rate. A configuration
sustains the highest rate up to which every rate met the attainment target (DistServe's goodput);
the best one of a budget sustains the most, then has the higher mean attainment, then the fewer
moving parts (colocated first, then always before auto). The verdict compares the best P+D
configuration with colocated K and names why, in a closed set of reasons: `prefill_interference`
(colocated misses mostly TPOT: prefill chunks stretch the decode steps they share),
`prefill_queueing` (colocated misses mostly TTFT), `migration_cost` (always-disaggregated sustains
less and one migration costs more than the prefill it moves: the first token streams from the
prefill worker, so the migration delays the second, and TPOT; named even when 'auto' ties
colocated by prefilling locally), `no_gain` (the same goodput: keep the simpler one),
`capacity_split` (otherwise: the split starves one side).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from measure.serve_metrics import SLO
from planner.des import SimConfig, simulate
from planner.metrics import summarize
from planner.model import StepModel


@dataclass(frozen=True)
class Target:
    slo: SLO = SLO()
    attainment: float = 0.9   # share of requests that must meet both SLOs


def configurations(budget: int, base: SimConfig) -> list[SimConfig]:
    out = [replace(base, colocated=budget)]
    for p in range(1, budget):
        out += [replace(base, colocated=0, prefill=p, decode=budget - p, decide=m)
                for m in ("always", "auto")]
    return out


def sweep(workload_at, model: StepModel, configs: list[SimConfig], rates, target: Target) -> list[dict]:
    """One row per configuration: its points (rate, metrics) and what it sustains."""
    rows = []
    for c in configs:
        points = [{"rate": r, **summarize(simulate(workload_at(r), model, c), target.slo)} for r in rates]
        rows.append({"config": c.label, "workers": c.workers, "sim": c, "points": points,
                     "sustained_rate": sustained(points, target.attainment),
                     "mean_attainment": statistics.mean(p["slo_attainment"] or 0.0 for p in points)})
    return rows


def sustained(points: list[dict], attainment: float) -> float:
    best = 0.0
    for p in sorted(points, key=lambda p: p["rate"]):
        if (p["slo_attainment"] or 0.0) < attainment:
            break
        best = p["rate"]
    return best


def _score(row: dict, order: int) -> tuple:
    return (row["sustained_rate"], round(row["mean_attainment"], 2), -order)


def best(rows: list[dict]) -> dict:
    return max(rows, key=lambda r: _score(r, rows.index(r)))


def _first_failing(row: dict, attainment: float) -> dict:
    pts = sorted(row["points"], key=lambda p: p["rate"])
    return next((p for p in pts if (p["slo_attainment"] or 0.0) < attainment), pts[-1])


def verdict(rows: list[dict], model: StepModel, target: Target, median_prompt: int) -> dict:
    """Does disaggregation pay for this budget's rows, and why (see the module doc)."""
    colo = next(r for r in rows if r["sim"].colocated)
    pd = [r for r in rows if not r["sim"].colocated]
    if not pd:
        return {"disaggregate": False, "reason_kind": "no_gain", "reason": "a budget of 1 cannot be split"}
    top = best(pd)
    pays = _score(top, 0)[:2] > _score(colo, 0)[:2]
    if pays:
        p = _first_failing(colo, target.attainment)
        kind = "prefill_interference" if p["tpot_misses"] >= p["ttft_misses"] else "prefill_queueing"
        why = (f"{colo['config']} sustains {colo['sustained_rate']:g} req/s, {top['config']} "
               f"{top['sustained_rate']:g}: at {p['rate']:g} req/s colocated misses "
               f"TPOT {p['tpot_misses']}x, "
               f"TTFT {p['ttft_misses']}x of {p['requests']}")
        return {"disaggregate": True, "reason_kind": kind, "reason": why, "best": top["config"]}
    always = best([r for r in pd if r["sim"].decide == "always"])
    p = _first_failing(always, target.attainment)
    mig, pre = model.migration_ms(median_prompt), model.prefill_ms(median_prompt)
    if always["sustained_rate"] < colo["sustained_rate"] and mig > pre:
        kind = "migration_cost"   # NOTE: before no_gain: 'auto' may tie by not disaggregating at all
    elif _score(top, 0)[:2] == _score(colo, 0)[:2]:
        kind = "no_gain"
    else:
        kind = "capacity_split"
    why = (f"{colo['config']} sustains {colo['sustained_rate']:g} req/s, best split {top['config']} "
           f"{top['sustained_rate']:g}; {always['config']} at {p['rate']:g} req/s misses TTFT "
           f"{p['ttft_misses']}x, TPOT {p['tpot_misses']}x of {p['requests']}; "
           f"a {median_prompt}-token prompt: "
           f"migration {mig:.1f} ms vs prefill {pre:.1f} ms")
    return {"disaggregate": False, "reason_kind": kind, "reason": why, "best": colo["config"]}


def plan(workload_at, model: StepModel, budgets, rates, target: Target, base: SimConfig,
         median_prompt: int) -> dict:
    """Every budget: its rows, its best configuration and the verdict."""
    out = {}
    for b in budgets:
        rows = sweep(workload_at, model, configurations(b, base), rates, target)
        out[b] = {"rows": rows, "best": best(rows)["config"],
                  "verdict": verdict(rows, model, target, median_prompt)}
    return out
