"""The serving benchmark's figure: TTFT (left) and TPOT (right) p50 and p99 against request rate,
one colour per mode (solid p50, dashed p99), from the report `coordinator.bench_serve` writes.
Matplotlib with the Agg backend (no display needed)."""

from __future__ import annotations

COLORS = {"disaggregated": "tab:blue", "colocated": "tab:orange"}


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    major = FuncFormatter(lambda v, _: f"{v:g}")
    minor = FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else "")

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    modes = sorted({r["mode"] for r in report["runs"]})
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        for mode in modes:
            runs = sorted((r for r in report["runs"] if r["mode"] == mode), key=lambda r: r["rate"])
            for pct, style in (("p50", "-"), ("p99", "--")):
                pts = [(r["rate"], r[key][pct]) for r in runs if r[key][pct] is not None]
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", color=COLORS.get(mode), label=f"{mode} {pct}")
        slo = report.get("slo", {}).get(key)
        if slo is not None:
            ax.axhline(slo, color="gray", linestyle=":", linewidth=1, label=f"SLO {slo:g} ms")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(major)
        ax.yaxis.set_minor_formatter(minor)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} vs request rate")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    cfg = report.get("config", {})
    fig.suptitle(f"pdserve bench serve: {cfg.get('preset', '')}, tiny model, "
                 f"{cfg.get('num_requests', '?')} requests per point (solid p50, dashed p99; log scale)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
