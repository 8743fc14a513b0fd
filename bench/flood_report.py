"""The report half of the flood check (see bench.flood): `summarize` turns the records of one
burst from `run_flood` into counts per status, latency percentiles, the Retry-After values seen,
/health probe latency and the list of violations of the properties bench.flood checks, and
`format_table` renders that summary as the Markdown table `pdserve bench flood` prints. Both are
re-exported by bench.flood, where callers import them.
"""

from __future__ import annotations


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))]


def summarize(report: dict) -> dict:
    """Counts per status, latency percentiles, Retry-After values, health probe latency, and the
    verdicts (`violations` lists everything that breaks the properties in the module doc)."""
    cfg = report["config"]
    recs, probes = report["records"], report["health"]
    counts: dict[str, int] = {}
    for r in recs:
        counts[str(r["status"])] = counts.get(str(r["status"]), 0) + 1
    lat = {s: [r["seconds"] for r in recs if r["status"] == s] for s in (200, 429)}
    retry = {}
    for r in recs:
        if r["status"] == 429:
            retry[str(r.get("retry_after"))] = retry.get(str(r.get("retry_after")), 0) + 1
    hs = [p["seconds"] for p in probes]
    violations = []
    for r in recs:
        if r["status"] not in (200, 429):
            why = r.get("error") or r.get("body", "")
            violations.append(f"request {r['index']}: status {r['status']} {why}")
        elif r["status"] == 200 and r.get("problem"):
            violations.append(f"request {r['index']}: malformed 200: {r['problem']}")
        elif r["status"] == 429 and not r.get("retry_after"):
            violations.append(f"request {r['index']}: 429 without Retry-After")
        if r.get("ended_s") is not None and r["ended_s"] > cfg["bound_s"]:
            violations.append(f"request {r['index']}: ended {r['ended_s']:.1f}s after the release")
    bad = [p for p in probes if p["status"] != 200 or p["seconds"] > cfg["health_bound_s"]]
    violations += [f"/health at {p['at_s']:.2f}s: status {p['status']} in {p['seconds']:.2f}s" for p in bad]
    if not probes:
        violations.append("no /health probe was answered during the flood")
    ends = [r["ended_s"] for r in recs if r.get("ended_s") is not None]
    ms = lambda x: None if x is None else round(1000 * x, 1)  # noqa: E731
    return {"requests": len(recs), "counts": counts, "wall_s": report["wall_s"],
            "last_end_s": round(max(ends), 3) if ends else None,
            "latency_ms": {str(s): {"p50": ms(_pct(v, 50)), "p99": ms(_pct(v, 99)),
                                    "max": ms(max(v, default=None))} for s, v in lat.items()},
            "retry_after": retry,
            "health": {"probes": len(probes), "ok": sum(p["status"] == 200 for p in probes),
                       "p50_ms": ms(_pct(hs, 50)), "p99_ms": ms(_pct(hs, 99)),
                       "max_ms": ms(max(hs, default=None))},
            "violations": violations}


def format_table(summary: dict) -> str:
    def f(x):
        return "-" if x is None else f"{x:g}"

    lines = [f"flood: {summary['requests']} simultaneous requests, wall {summary['wall_s']:.2f} s "
             f"(last answer {f(summary['last_end_s'])} s after release)",
             "", "| status | count | latency p50 ms | p99 ms | max ms |", "|---|---|---|---|---|"]
    for status, count in sorted(summary["counts"].items()):
        lat = summary["latency_ms"].get(status, {})
        lines.append(f"| {status} | {count} | {f(lat.get('p50'))} | {f(lat.get('p99'))} | "
                     f"{f(lat.get('max'))} |")
    h = summary["health"]
    retry = ", ".join(f"{v}s x{n}" for v, n in sorted(summary["retry_after"].items())) or "-"
    lines += ["", f"Retry-After seen: {retry}",
              f"/health during the flood: {h['ok']}/{h['probes']} answered 200; p50 {f(h['p50_ms'])} ms, "
              f"p99 {f(h['p99_ms'])} ms, max {f(h['max_ms'])} ms"]
    if summary["violations"]:
        bad = summary["violations"]
        lines += ["", f"VIOLATIONS ({len(bad)}):"] + [f"  {v}" for v in bad[:20]]
    return "\n".join(lines)
