"""The serving benchmark's report as people read it, from the JSON `measure.serve` writes: one line
per run (`format_run`), a markdown table of every run (`format_table`: TTFT/TPOT/ITL percentiles,
goodput, migration's share of TTFT p50, and for streamed migrations the median % of payload sent
before the prefill finished and the median exposed ms), goodput side by side per rate
(`format_goodput`), the low-load TTFT overhead (`format_overhead`), and the figure (`plot`): TTFT
(left) and TPOT (right) p50 and p99 against request rate, one colour per setup (solid p50, dashed
p99), on a log scale. Matplotlib with the Agg backend (no display needed), imported only when
plotting. A report from before runs had labels reads as one setup per mode.
"""

from __future__ import annotations

import os

COLORS = {"disaggregated": "tab:blue", "disaggregated-whole": "tab:green", "colocated": "tab:orange",
          "per-request": "tab:red", "colocated-128": "tab:brown", "colocated-256": "tab:olive",
          "colocated-512": "tab:orange", "colocated-1024": "tab:pink"}
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*")  # one per setup, so lines that overlap stay apart
NAMES = {"disaggregated": "disaggregated, streamed", "disaggregated-whole": "disaggregated, whole"}


def run_label(r: dict) -> str:
    return r.get("label") or r["mode"]


def _name(lbl: str) -> str:
    return NAMES.get(lbl, lbl)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    major = FuncFormatter(lambda v, _: f"{v:g}")
    minor = FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else "")

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = sorted({run_label(r) for r in report["runs"]})
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        for k, lbl in enumerate(labels):
            runs = sorted((r for r in report["runs"] if run_label(r) == lbl), key=lambda r: r["rate"])
            for pct, style in (("p50", "-"), ("p99", "--")):
                pts = [(r["rate"], r[key][pct]) for r in runs if r[key][pct] is not None]
                if pts:
                    ax.plot(*zip(*pts), style, marker=MARKERS[k % len(MARKERS)], color=COLORS.get(lbl),
                            label=f"{_name(lbl)} {pct}")
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
    n = cfg.get("num_requests", "?")
    quick = " (quick: p99 ≈ max)" if cfg.get("p99_note") else ""
    budget = f", step budget {cfg['step_budget']}" if cfg.get("step_budget") else ""
    work = cfg.get("preset") or os.path.basename(cfg.get("trace") or "")
    fig.suptitle(f"pdserve bench serve: {work}, {cfg.get('model', 'tiny')} model{budget}, "
                 f"{n} requests per point{quick} (solid p50, dashed p99; log scale)", fontsize=10)
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
            f"{_p(r, 'migration_share_of_ttft', 'p50', 3)}{_streamed(r)}")


def _streamed(r: dict) -> str:
    if not r.get("streamed_migrations"):
        return ""
    return (f" | streamed {r['streamed_migrations']}/{r['migrated']}: overlap p50 "
            f"{_p(r, 'overlap_pct', 'p50', 0)}%, exposed p50 {_p(r, 'exposed_ms', 'p50')} ms")


def _get(r: dict, key: str, p: str, nd: int = 1) -> str:
    return fmt((r.get(key) or {}).get(p), nd)


def format_table(report: dict) -> str:
    """Every run; latencies in ms. streamed: the cluster's stream_migration; 'streamed n/m': m
    requests migrated, n of them streamed; overlap: median % of a streamed migration's payload sent
    before its prefill finished; exposed: median ms of it left after the prefill."""
    head = ("| mode | streamed | rate (req/s) | done/failed | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | "
            "ITL p99 | tok/s | goodput (req/s) | migration share of TTFT p50/p99 | streamed n/m | "
            "overlap % p50 | exposed ms p50 |")
    lines = [head, "|" + "---|" * 15]
    for r in sorted(report["runs"], key=lambda r: (r["rate"], r["mode"], not r.get("streamed", False))):
        share = "migration_share_of_ttft"
        yes = "yes" if r.get("streamed") else "no"
        mig = f"{r.get('streamed_migrations', 0)}/{r['migrated']}" if r["mode"] != "colocated" else "-"
        name = run_label(r) if r["mode"] == "colocated" else r["mode"]  # colocated-N: its chunk budget
        lines.append(f"| {name} | {yes} | {r['rate']:g} | {r['completed']}/{r['failed']} | "
                     f"{_p(r, 'ttft_ms', 'p50')} | {_p(r, 'ttft_ms', 'p99')} | {_p(r, 'tpot_ms', 'p50')} | "
                     f"{_p(r, 'tpot_ms', 'p99')} | {_p(r, 'itl_ms', 'p99')} | {r['throughput_tok_s']:.0f} | "
                     f"{r['goodput_req_s']:.2f} | "
                     f"{_p(r, share, 'p50', 3)} / {_p(r, share, 'p99', 3)} | {mig} | "
                     f"{_get(r, 'overlap_pct', 'p50', 0)} | {_get(r, 'exposed_ms', 'p50')} |")
    return "\n".join(lines)


def format_goodput(report: dict) -> str:
    """Goodput (req/s meeting both SLOs) per rate, one column per setup, and the SLO attainment."""
    labels = []
    for r in report["runs"]:
        if run_label(r) not in labels:
            labels.append(run_label(r))
    by = {(r["rate"], run_label(r)): r for r in report["runs"]}
    lines = ["| rate (req/s) | " + " | ".join(f"{_name(lbl)} goodput (attained)" for lbl in labels) + " |",
             "|" + "---|" * (len(labels) + 1)]
    for rate in sorted({r["rate"] for r in report["runs"]}):
        cells = []
        for lbl in labels:
            r = by.get((rate, lbl))
            att = r.get("slo_attainment") if r else None
            pct = fmt(None if att is None else 100 * att, 0)
            cells.append("-" if r is None else f"{r['goodput_req_s']:.2f} ({pct}%)")
        lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_overhead(report: dict) -> str:
    lines = ["| setup | TTFT p50 max_tokens=1 | TTFT p50 full | added (client) | added (server) | "
             "migration p50 (streamed: exposed) | streamed |", "|" + "---|" * 7]
    for lbl, o in (report.get("overhead") or {}).items():
        if o:
            only, full = o["prefill_only"], o["full"]
            n = full.get("streamed_migrations")
            st = "-" if n is None else f"{n}/{full['completed']}"
            lines.append(f"| {_name(lbl)} | {_p(only, 'ttft_ms', 'p50')} | {_p(full, 'ttft_ms', 'p50')} | "
                         f"{fmt(o['added_ttft_ms_p50'])} | {fmt(o['added_server_ttft_ms_p50'])} | "
                         f"{_p(full, 'migration_ms', 'p50')} | {st} |")
    return "\n".join(lines)


def format_goodput_search(report: dict) -> str:
    """Per setup: goodput (the highest rate at which >= 90% of requests met both SLOs), its interval
    (measure.serve_goodput), the rates measured, and beside the best colocated budget: the ratio and
    whether the intervals overlap (a tie)."""
    against = report.get("against_best_colocated") or {}
    best = (report.get("best_colocated") or {}).get("label")
    lines = ["| setup | goodput (req/s) | interval | rates measured (attainment) | vs best colocated |",
             "|---|---|---|---|---|"]
    for lbl, g in (report.get("goodput") or {}).items():
        ci = g["ci"]
        hi = "open" if ci[1] is None else f"{ci[1]:.2f}"
        steps = ", ".join(f"{s['rate']:.2g} ({100 * s['attainment']:.0f}%)" for s in g["steps"])
        a = against.get(lbl)
        if lbl == best or a is None:
            vs = "baseline" if lbl == best else "-"
        else:
            vs = ("-" if a["ratio"] is None else f"{a['ratio']:.2f}x") + (" (tie)" if a["tie"] else "")
        lines.append(f"| {_name(lbl)} | {g['goodput_req_s']:.2f} | {ci[0]:.2f}..{hi} | {steps} | {vs} |")
    return "\n".join(lines)
