"""The serving benchmark's report as people read it, from the JSON `bench.serve` writes: one line
per run (`format_run`), a markdown table of every run (`format_table`) and of the low-load TTFT
overhead (`format_overhead`), and the figure (`plot`): TTFT (left) and TPOT (right) p50 and p99
against request rate, one colour per mode (solid p50, dashed p99), on a log scale. Matplotlib
with the Agg backend (no display needed), imported only when plotting.
"""

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


def fmt(x, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _p(r: dict, key: str, p: str, nd: int = 1) -> str:
    return fmt(r[key][p], nd)


def format_run(r: dict) -> str:
    return (f"done {r['completed']} failed {r['failed']} | TTFT p50/p99 {_p(r, 'ttft_ms', 'p50')}/"
            f"{_p(r, 'ttft_ms', 'p99')} ms | TPOT p50/p99 {_p(r, 'tpot_ms', 'p50')}/"
            f"{_p(r, 'tpot_ms', 'p99')} ms | {r['throughput_tok_s']:.0f} tok/s | goodput "
            f"{r['goodput_req_s']:.2f} req/s | migration/TTFT p50 "
            f"{_p(r, 'migration_share_of_ttft', 'p50', 3)}")


def format_table(report: dict) -> str:
    head = ("| mode | rate (req/s) | done/failed | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | ITL p99 | "
            "tok/s | goodput (req/s) | migration share of TTFT p50/p99 |")
    lines = [head, "|" + "---|" * 11]
    for r in sorted(report["runs"], key=lambda r: (r["rate"], r["mode"])):
        share = "migration_share_of_ttft"
        lines.append(f"| {r['mode']} | {r['rate']:g} | {r['completed']}/{r['failed']} | "
                     f"{_p(r, 'ttft_ms', 'p50')} | {_p(r, 'ttft_ms', 'p99')} | {_p(r, 'tpot_ms', 'p50')} | "
                     f"{_p(r, 'tpot_ms', 'p99')} | {_p(r, 'itl_ms', 'p99')} | {r['throughput_tok_s']:.0f} | "
                     f"{r['goodput_req_s']:.2f} | "
                     f"{_p(r, share, 'p50', 3)} / {_p(r, share, 'p99', 3)} |")
    return "\n".join(lines)


def format_overhead(report: dict) -> str:
    lines = ["| mode | TTFT p50 max_tokens=1 | TTFT p50 full | added (client) | added (server) | "
             "migration p50 |", "|" + "---|" * 6]
    for mode, o in (report.get("overhead") or {}).items():
        if o:
            only, full = o["prefill_only"], o["full"]
            lines.append(f"| {mode} | {_p(only, 'ttft_ms', 'p50')} | {_p(full, 'ttft_ms', 'p50')} | "
                         f"{fmt(o['added_ttft_ms_p50'])} | {fmt(o['added_server_ttft_ms_p50'])} | "
                         f"{_p(full, 'migration_ms', 'p50')} |")
    return "\n".join(lines)
