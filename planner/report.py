"""The planner's output: the per-budget table (configuration, sustained rate, and at the highest
rate every configuration was simulated at: goodput, attainment, TTFT/TPOT p50/p99), the verdict and
the per-request threshold, the JSON (the same, every point included) and the plot of goodput
against rate, one line per configuration (each its own marker and line style) and one panel per
budget (matplotlib, Agg).
"""

from __future__ import annotations


def _f(x, nd=1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def format_plan(result: dict, threshold: dict) -> str:
    lines = []
    for budget, b in result.items():
        lines.append(f"budget {budget} workers")
        lines.append("| config | sustained req/s | rate | goodput | attained | TTFT p50/p99 ms "
                     "| TPOT p50/p99 ms | paths |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for r in b["rows"]:
            for p in r["points"]:
                lines.append(
                    f"| {r['config']} | {r['sustained_rate']:g} | {p['rate']:g} | {p['goodput_req_s']:.2f} | "
                    f"{100 * (p['slo_attainment'] or 0):.0f}% | "
                    f"{_f(p['ttft_ms']['p50'])}/{_f(p['ttft_ms']['p99'])} | "
                    f"{_f(p['tpot_ms']['p50'], 2)}/{_f(p['tpot_ms']['p99'], 2)} | "
                    f"{', '.join(f'{k} {v}' for k, v in sorted(p['paths'].items()))} |")
        v = b["verdict"]
        lines.append(f"best: {b['best']}")
        lines.append(f"disaggregation pays: {'yes' if v['disaggregate'] else 'no'} "
                     f"({v['reason_kind']}): {v['reason']}")
    lines.append(f"per-request threshold: prefill on the decode worker when the uncached prompt <= "
                 f"{threshold['local_prefill_max_tokens']} tokens (ClusterConfig); the profile's crossover "
                 f"m0/(p - m1) = {threshold['profile_crossover']}")
    return "\n".join(lines)


def to_json(result: dict, threshold: dict, inputs: dict) -> dict:
    budgets = {}
    for budget, b in result.items():
        budgets[str(budget)] = {"best": b["best"], "verdict": b["verdict"],
                                "configs": [{k: v for k, v in r.items() if k != "sim"} for r in b["rows"]]}
    return {"inputs": inputs, "threshold": threshold, "budgets": budgets}


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", "-.", ":")


def style(i: int) -> dict:
    """The i-th configuration's line: its own marker and line style, hollow markers that shrink with
    i, so configurations predicted the same goodput (lines on top of each other) all stay visible."""
    return {"marker": MARKERS[i % len(MARKERS)], "linestyle": LINESTYLES[i % len(LINESTYLES)],
            "markersize": max(3.0, 11.0 - 1.5 * i), "fillstyle": "none", "linewidth": 1.5}


def figure(result: dict):
    """The goodput-vs-rate figure: one panel per budget, one line per configuration (`style`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result), figsize=(6 * len(result), 4), squeeze=False)
    for ax, (budget, b) in zip(axes[0], result.items()):
        for i, r in enumerate(b["rows"]):
            xs = [p["rate"] for p in r["points"]]
            ax.plot(xs, [p["goodput_req_s"] for p in r["points"]], label=r["config"], **style(i))
        ax.plot(xs, xs, color="grey", linestyle=":", linewidth=1, label="offered")
        ax.set_title(f"budget {budget}: best {b['best']}")
        ax.set_xlabel("rate (req/s)")
        ax.set_ylabel("predicted goodput (req/s)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot(result: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    fig = figure(result)
    fig.savefig(path, dpi=100)
    plt.close(fig)
