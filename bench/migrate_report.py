"""Turn a migration benchmark report (from `measure.migrate`) into a summary and a two-panel plot
(latency against tokens; GB/s of each transport against the baselines at the largest payload).

The summary (`summarize`) holds, per transport:
- `largest`: GB/s at its largest payload, and `vs_<baseline>` ratios against the baselines
  measured at that same size: raw_tcp (a well-made two-process socket), raw_tcp_xxh3 (the same,
  hashing every piece on both ends), ray_put_get, nixl and nixl_xxh3 (the same, hashing the
  payload on both ends; when measured), memcpy, pickle_pipe (None
  where the baseline was not measured);
- `fixed_overhead_ms`: the per-transfer fixed cost, as the intercept of a least-squares fit of p50
  latency against payload bytes over the small points (every point of at most 1 MiB; if those
  span fewer than two sizes, the three smallest points), with the fit's slope (ms per MiB), the
  number of points and their largest size; the p50 of the smallest point is kept beside it
  (`smallest_p50_ms`). The per-size p50s stay in the report's `results`.
"""

from __future__ import annotations

import math

RATIO_BASELINES = ("raw_tcp", "raw_tcp_xxh3", "ray_put_get", "nixl", "nixl_xxh3", "memcpy", "pickle_pipe")
DEVICE_BASELINES = ("pinned_d2h", "pinned_h2d")  # only in runs with device pools
FIT_MAX_BYTES = 1 << 20


def _baseline(report: dict, name: str, nbytes: int) -> float | None:
    for b in report["baselines"]:
        if b["name"] == name and b["bytes"] == nbytes and b.get("gb_per_s"):
            return b["gb_per_s"]
    return None


def fit_overhead(rows: list[dict], max_bytes: int = FIT_MAX_BYTES) -> dict | None:
    """Least-squares latency_ms_p50 = intercept + slope * MiB over the small rows (see module doc);
    None when fewer than two distinct sizes are available."""
    small = [r for r in rows if r["bytes"] <= max_bytes]
    if len({r["bytes"] for r in small}) < 2:
        small = sorted(rows, key=lambda r: r["bytes"])[:3]
    if len({r["bytes"] for r in small}) < 2:
        return None
    x = [r["bytes"] / 2**20 for r in small]
    y = [r["latency_ms_p50"] for r in small]
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxx = sum((a - mx) ** 2 for a in x)
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y)) / sxx
    intercept = my - slope * mx
    smallest = min(small, key=lambda r: r["bytes"])
    return {"intercept_ms": intercept, "slope_ms_per_mib": slope, "points": len(small),
            "max_bytes": max(r["bytes"] for r in small), "kv_shapes": sorted({r["kv_shape"] for r in small}),
            "smallest_p50_ms": smallest["latency_ms_p50"], "smallest_bytes": smallest["bytes"]}


def summarize(report: dict) -> dict:
    res = report["results"]
    out: dict = {"all_verified": all(r["verified"] for r in res), "largest": [], "fixed_overhead_ms": {}}
    for t in sorted({r["transport"] for r in res}):
        rows = [r for r in res if r["transport"] == t]
        big = max(rows, key=lambda r: r["bytes"])
        entry = {"transport": t, "kv_shape": big["kv_shape"], "tokens": big["tokens"], "bytes": big["bytes"],
                 "gb_per_s": big["gb_per_s"], "manifest_ratio": big["manifest_ratio"]}
        device = [n for n in DEVICE_BASELINES if any(b["name"] == n for b in report["baselines"])]
        for name in RATIO_BASELINES + tuple(device):
            base = _baseline(report, name, big["bytes"])
            entry[f"vs_{name}"] = big["gb_per_s"] / base if base else None
            entry[f"{name}_gb_per_s"] = base
        out["largest"].append(entry)
        fit = fit_overhead(rows)
        if fit is not None:
            out["fixed_overhead_ms"][t] = fit
    realistic = [r for r in res if r["bytes"] >= 1 << 20]
    out["max_manifest_ratio_at_1MiB_plus"] = max((r["manifest_ratio"] for r in realistic), default=None)
    return out


def format_summary(s: dict) -> str:
    lines = [f"all transfers verified: {s['all_verified']}"]
    for e in s["largest"]:
        lines.append(f"{e['transport']:8s} largest point ({e['kv_shape']}, {e['tokens']} tokens, "
                     f"{e['bytes'] / 2**20:.3g} MiB): {e['gb_per_s']:.3g} GB/s; "
                     f"manifest/payload {e['manifest_ratio']:.2e}")
        ratios = []
        for name in [n for n in RATIO_BASELINES + DEVICE_BASELINES if f"vs_{n}" in e]:
            v, base = e.get(f"vs_{name}"), e.get(f"{name}_gb_per_s")
            ratios.append(f"{v:.3g}x {name} ({base:.3g} GB/s)" if v else f"{name} n/a")
        lines.append(f"{'':8s}   = " + ", ".join(ratios))
    for t, f in s["fixed_overhead_ms"].items():
        ok = math.isfinite(f["intercept_ms"])
        lines.append(f"{t:8s} fixed overhead: intercept {f['intercept_ms']:.3f} ms"
                     f"{'' if ok else ' (not finite)'}, slope {f['slope_ms_per_mib']:.3f} ms/MiB "
                     f"(least squares over {f['points']} points <= {f['max_bytes'] / 1024:.0f} KiB, "
                     f"{'/'.join(f['kv_shapes'])}); smallest point p50 {f['smallest_p50_ms']:.3f} ms "
                     f"at {f['smallest_bytes'] / 1024:.1f} KiB")
    if s["max_manifest_ratio_at_1MiB_plus"] is not None:
        ratio = s["max_manifest_ratio_at_1MiB_plus"]
        lines.append(f"max manifest/payload for payloads >= 1 MiB: {ratio:.2e}")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report["results"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    keys = sorted({(r["transport"], r["kv_shape"], r["block_size"]) for r in res})
    ax1.set_prop_cycle(color=[plt.get_cmap("tab20")(i % 20) for i in range(len(keys))])  # one each
    for key in keys:
        rows = sorted((r for r in res if (r["transport"], r["kv_shape"], r["block_size"]) == key),
                      key=lambda r: r["tokens"])
        x = [r["tokens"] for r in rows]
        p50 = [r["latency_ms_p50"] for r in rows]
        p99 = [r["latency_ms_p99"] for r in rows]
        line, = ax1.plot(x, p50, marker="o", label=f"{key[0]} {key[1]} B={key[2]}")
        ax1.plot(x, p99, linestyle=":", color=line.get_color())
    ax1.set(xscale="log", yscale="log", xlabel="tokens migrated",
            ylabel="latency (ms): p50 solid, p99 dotted", title="pool -> pool migration latency")
    ticks = sorted({r["tokens"] for r in res})
    ax1.set_xticks(ticks, [str(t) for t in ticks])
    ax1.minorticks_off()
    ax1.grid(True, which="major", alpha=0.3)
    ax1.legend(fontsize=7)
    nbytes = max(r["bytes"] for r in res)
    bars = [(r["transport"], r["gb_per_s"]) for r in res if r["bytes"] == nbytes]
    transports = {n for n, _ in bars}
    # a baseline named like a transport (nixl) gets its own bar, not the transport's
    bars += [(b["name"] + (" (bare)" if b["name"] in transports else ""), b["gb_per_s"])
             for b in report["baselines"] if b["bytes"] == nbytes and b.get("gb_per_s")]
    names = [n for n, _ in bars]
    colors = ["tab:blue"] * len(transports) + ["tab:gray"] * (len(bars) - len(transports))
    ax2.bar(names, [v for _, v in bars], color=colors)
    for i, (_, v) in enumerate(bars):
        ax2.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    missing = [b["name"] for b in report["baselines"] if b["bytes"] == nbytes and not b.get("gb_per_s")]
    note = f" (n/a: {', '.join(missing)})" if missing else ""
    ax2.set(ylabel="GB/s", title=f"throughput at {nbytes / 2**20:.0f} MiB vs baselines (gray){note}")
    ax2.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
