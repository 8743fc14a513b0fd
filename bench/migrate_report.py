"""Turn a migration benchmark report (from `bench.migrate`) into a summary (ratios against the
baselines at the same payload size, manifest overhead, fixed per-transfer overhead) and a
two-panel plot: latency against tokens, and GB/s of each transport against the baselines at the
largest payload.
"""

from __future__ import annotations


def _baseline(report: dict, name: str, nbytes: int) -> float | None:
    for b in report["baselines"]:
        if b["name"] == name and b["bytes"] == nbytes and b.get("gb_per_s"):
            return b["gb_per_s"]
    return None


def summarize(report: dict) -> dict:
    res = report["results"]
    out: dict = {"all_verified": all(r["verified"] for r in res), "largest": [], "fixed_overhead_ms": {}}
    for t in sorted({r["transport"] for r in res}):
        rows = [r for r in res if r["transport"] == t]
        big = max(rows, key=lambda r: r["bytes"])
        entry = {"transport": t, "kv_shape": big["kv_shape"], "tokens": big["tokens"], "bytes": big["bytes"],
                 "gb_per_s": big["gb_per_s"], "manifest_ratio": big["manifest_ratio"]}
        for name in ("raw_tcp", "memcpy", "pickle_pipe", "nixl"):
            base = _baseline(report, name, big["bytes"])
            entry[f"vs_{name}"] = big["gb_per_s"] / base if base else None
        out["largest"].append(entry)
        small = [r for r in rows if r["blocks"] <= 64 and r["bytes"] <= 1 << 20]
        if small:
            worst = max(small, key=lambda r: r["latency_ms_p50"])
            keys = ("latency_ms_p50", "blocks", "bytes", "kv_shape")
            out["fixed_overhead_ms"][t] = {k: worst[k] for k in keys}
    realistic = [r for r in res if r["bytes"] >= 1 << 20]
    out["max_manifest_ratio_at_1MiB_plus"] = max((r["manifest_ratio"] for r in realistic), default=None)
    return out


def format_summary(s: dict) -> str:
    lines = [f"all transfers verified: {s['all_verified']}"]
    for e in s["largest"]:
        ratios = ", ".join(f"{k[3:]} x{v:.2f}" for k, v in e.items() if k.startswith("vs_") and v)
        lines.append(f"{e['transport']:8s} largest point ({e['kv_shape']}, {e['tokens']} tokens, "
                     f"{e['bytes'] / 2**20:.0f} MiB): {e['gb_per_s']:.2f} GB/s; {ratios}; "
                     f"manifest/payload {e['manifest_ratio']:.2e}")
    for t, f in s["fixed_overhead_ms"].items():
        lines.append(f"{t:8s} fixed overhead (<=64 blocks, {f['bytes'] / 1024:.0f} KiB, {f['kv_shape']}): "
                     f"p50 {f['latency_ms_p50']:.2f} ms")
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
    for key in sorted({(r["transport"], r["kv_shape"], r["block_size"]) for r in res}):
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
    bars += [(b["name"], b["gb_per_s"]) for b in report["baselines"]
             if b["bytes"] == nbytes and b.get("gb_per_s")]
    names = [n for n, _ in bars]
    colors = ["tab:blue" if n in {r["transport"] for r in res} else "tab:gray" for n in names]
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
