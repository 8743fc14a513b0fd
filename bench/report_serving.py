"""The serving study's part of docs/results.md: one row per workload from a machine's
`serve-<workload>.json` (`pdserve bench serve`) and, beside it, `plan-<workload>.json` (`pdserve plan`
on the same workload, held to the SLOs that bench serve measured), and the goodput plot.

Per workload: the SLOs, each setup's measured goodput with its interval (measure.serve_goodput), the
best colocated chunk budget (the baseline), 1P+1D and per-request against it (a ratio, or a tie where
the intervals overlap), the migration share of TTFT p50 (from the overhead measurement, requests one
at a time), and the planner's predicted goodput per configuration with its pick. `plot` draws the
measured goodputs with their intervals and the planner's predictions as markers, one group per
workload.
"""

from __future__ import annotations

import os
from pathlib import Path

from planner.validate import SERVE_LABELS  # bench serve's kinds -> the planner's configurations

KINDS = ("colocated", "disaggregated", "per-request")
PLOT = "serve-goodput.png"  # written beside the JSON by `pdserve bench report`


def workload(record: dict) -> str:
    cfg = record.get("config", {})
    return cfg.get("preset") or f"trace {os.path.basename(cfg.get('trace') or '?')}"


def kind(label: str) -> str:
    """'colocated-128' -> 'colocated'; 'disaggregated-whole' -> 'disaggregated'."""
    for k in KINDS:
        if label == k or label.startswith(k + "-"):
            return k
    return label


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _ci(g: dict) -> str:
    lo, hi = g["ci"]
    return f"{_g(g['goodput_req_s'])} [{_g(lo)}–{'open' if hi is None else _g(hi)}]"


def measured(record: dict) -> dict[str, dict]:
    """{kind: the goodput entry of its best setup} (the best colocated budget, the streamed 1P+1D
    before the whole one where both ran), with 'label' added."""
    out: dict[str, dict] = {}
    for lbl, g in (record.get("goodput") or {}).items():
        k = kind(lbl)
        if k not in out or g["goodput_req_s"] > out[k]["goodput_req_s"]:
            out[k] = {**g, "label": lbl}
    return out


def predicted(plan: dict | None) -> tuple[dict[str, float], str | None]:
    """({kind: the planner's sustained rate}, its pick as a kind) from a plan JSON's 2-worker budget."""
    if not plan:
        return {}, None
    budget = (plan.get("budgets") or {}).get("2")
    if not budget:
        return {}, None
    by_config = {c["config"]: c["sustained_rate"] for c in budget["configs"]}
    back = {v: k for k, v in SERVE_LABELS.items()}
    return ({k: by_config[c] for k, c in SERVE_LABELS.items() if c in by_config},
            back.get(budget["best"], budget["best"]))


def migration_share(record: dict) -> float | None:
    """The 1P+1D migration time p50 over its TTFT p50, requests one at a time (None if not measured)."""
    for lbl, o in (record.get("overhead") or {}).items():
        if kind(lbl) == "disaggregated" and o:
            mig, ttft = o["full"]["migration_ms"]["p50"], o["full"]["ttft_ms"]["p50"]
            if mig is not None and ttft:
                return mig / ttft
    return None


def _vs(m: dict, k: str, base: str = "colocated") -> str:
    if k not in m or base not in m or not m[base]["goodput_req_s"]:
        return "-"
    from measure.serve_goodput import tie

    ratio = m[k]["goodput_req_s"] / m[base]["goodput_req_s"]
    return f"{ratio:.2f}x" + (" (tie)" if tie(m[k]["ci"], m[base]["ci"]) else "")


def studies(runs: dict[str, dict]) -> list[tuple[str, dict, dict | None]]:
    """(workload name, serve record, plan record or None) for each serve-*.json of one machine."""
    out = []
    for bench, record in runs.items():
        if bench.startswith("serve-"):
            out.append((workload(record), record, runs.get("plan-" + bench.removeprefix("serve-"))))
    return out


def table(runs: dict[str, dict]) -> list[str]:
    """The Markdown lines of the study's table for one machine ([] when it has no serve-*.json)."""
    rows = studies(runs)
    if not rows:
        return []
    lines = ["| workload | SLO TTFT / TPOT ms | best colocated | 1P+1D | per-request | 1P+1D vs colocated "
             "| per-request vs best | migration share of TTFT | plan: colocated / 1P+1D / auto | plan picks "
             "| measured best |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, record, plan in rows:
        m = measured(record)
        pred, pick = predicted(plan)
        slo = record.get("slo", {})
        best_other = max((k for k in ("colocated", "disaggregated") if k in m),
                         key=lambda k: m[k]["goodput_req_s"], default=None)
        share = migration_share(record)
        best = best_measured(m)
        lines.append(
            f"| {name} | {slo.get('ttft_ms', 0):.0f} / {slo.get('tpot_ms', 0):.1f} "
            f"| {_ci(m['colocated']) + ' (' + m['colocated']['label'] + ')' if 'colocated' in m else '-'} "
            f"| {_ci(m['disaggregated']) if 'disaggregated' in m else '-'} "
            f"| {_ci(m['per-request']) if 'per-request' in m else '-'} "
            f"| {_vs(m, 'disaggregated')} | {_vs(m, 'per-request', best_other) if best_other else '-'} "
            f"| {'-' if share is None else f'{100 * share:.1f}%'} "
            f"| {' / '.join(_g(pred.get(k)) for k in KINDS) if pred else '-'} | {pick or '-'} | {best} |")
    return lines


def _at(record: dict, label: str, rate: float) -> str:
    """'TTFT p50/p99 s, TPOT p50/p99 ms' of setup `label`'s run nearest `rate` (its rate named when
    it is not `rate`; '-' if it ran none)."""
    import math

    ran = [r for r in record.get("runs", []) if r.get("label") == label and r.get("rate")]
    if not ran:
        return "-"
    run = min(ran, key=lambda r: abs(math.log(r["rate"] / rate)))
    t, p = run["ttft_ms"], run["tpot_ms"]
    if t.get("p50") is None or p.get("p50") is None:
        return "-"
    where = "" if abs(run["rate"] - rate) <= 1e-9 * max(1.0, rate) else f" (at {run['rate']:.3g})"
    return f"{t['p50'] / 1e3:.2f}/{t['p99'] / 1e3:.2f} s, {p['p50']:.0f}/{p['p99']:.0f} ms{where}"


def saturation(runs: dict[str, dict]) -> list[str]:
    """Per workload: TTFT and TPOT p50/p99 of each kind's best setup at the rate where the best
    configuration saturates (the lowest rate it failed above its goodput), or at the nearest rate
    that setup ran."""
    rows = studies(runs)
    if not rows:
        return []
    lines = ["| workload | best | saturates at (req/s) | colocated TTFT p50/p99, TPOT p50/p99 | 1P+1D "
             "| per-request |", "|---|---|---|---|---|---|"]
    for name, record, _ in rows:
        m = measured(record)
        if not m:
            continue
        top = max(m, key=lambda k: m[k]["goodput_req_s"])
        rate = m[top]["bracket"][1] if m[top].get("bracket") else None
        cells = [_at(record, m[k]["label"], rate) if k in m and rate is not None else "-" for k in KINDS]
        lines.append(f"| {name} | {m[top]['label']} | {'-' if rate is None else f'{rate:.3g}'} | "
                     + " | ".join(cells) + " |")
    return lines


def best_measured(m: dict[str, dict]) -> str:
    """The kind with the highest goodput, and every kind whose interval overlaps it (a tie)."""
    from measure.serve_goodput import tie

    if not m:
        return "-"
    top = max(m, key=lambda k: m[k]["goodput_req_s"])
    tied = [k for k in KINDS if k in m and k != top and tie(m[k]["ci"], m[top]["ci"])]
    return top + (f" (tie: {', '.join(tied)})" if tied else "")


def plot(runs: dict[str, dict], path: Path) -> bool:
    """The goodput figure: per workload, each kind's measured goodput (a bar, its interval as the
    error bar; an open interval drawn to the top) and the planner's prediction (a marker). False when
    the machine has no serve-*.json."""
    rows = studies(runs)
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(rows)), 4))
    width = 0.8 / len(KINDS)
    top = max((g["goodput_req_s"] for _, r, _ in rows for g in (r.get("goodput") or {}).values()), default=1)
    for i, k in enumerate(KINDS):
        xs, ys, lo, hi, px, py = [], [], [], [], [], []
        for j, (_, record, plan) in enumerate(rows):
            m, (pred, _) = measured(record), predicted(plan)
            x = j + (i - 1) * width
            if k in m:
                g = m[k]
                xs.append(x)
                ys.append(g["goodput_req_s"])
                lo.append(g["goodput_req_s"] - g["ci"][0])
                up = g["ci"][1] if g["ci"][1] is not None else 1.25 * top
                hi.append(max(0.0, up - g["goodput_req_s"]))
            if k in pred:
                px.append(x)
                py.append(pred[k])
        bars = ax.bar(xs, ys, width, label=f"{k} (measured)", yerr=[lo, hi], capsize=3)
        ax.plot(px, py, linestyle="none", marker="D", markersize=6, fillstyle="none",
                color=bars.patches[0].get_facecolor() if bars.patches else None, markeredgewidth=1.5,
                label=f"{k} (planner)")
    ax.set_xticks(range(len(rows)), [name for name, _, _ in rows], rotation=15, fontsize=8)
    ax.set_ylabel("goodput (req/s at >= 90% within both SLOs)")
    ax.set_title("SmolLM2 serving goodput: measured (bars, 95% interval) and predicted (diamonds)")
    ax.legend(fontsize=7, ncols=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
