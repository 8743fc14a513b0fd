"""The serving benchmark's metrics, computed from the client-side records `measure.loadgen` keeps:
TTFT, TPOT ((e2e - ttft) / (output tokens - 1)), ITL (each chunk's gap spread over its tokens),
e2e latency and their p50/p90/p99, output tokens/s, goodput (requests/s meeting BOTH the TTFT
and the TPOT SLO, as DistServe defines it) and the server-reported KV migration time as a share
of client TTFT (for a streamed migration that time is only its exposed part, after the prefill
finished), the streamed migrations' overlap (% of payload sent while the prompt was still
computing) and exposed ms, plus the same quantities under vLLM `bench serve`'s result-file names.
Only completed requests enter the latencies; a run with none gives None, never NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from measure.loadgen import RequestRecord

PCTS = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    """Goodput thresholds (ms): a request counts when its TTFT <= ttft_ms AND TPOT <= tpot_ms
    (a one-token answer has no TPOT and meets that half). The defaults are about 5x the
    unloaded latencies of the tiny model on a 2-core CPU (a 768-token prefill ~100 ms, a decode
    step ~5 ms), DistServe's way of scaling SLOs to the model and machine."""

    ttft_ms: float = 500.0
    tpot_ms: float = 25.0


def percentiles(values: list[float]) -> dict:
    """p50/p90/p99 (numpy's linear interpolation, as vLLM); None for each when there are no values."""
    if not values:
        return {f"p{p}": None for p in PCTS}
    arr = np.asarray(values, dtype=float)
    return {f"p{p}": float(np.percentile(arr, p)) for p in PCTS}


def ttft_ms(r: RequestRecord) -> float:
    return (r.first_s - r.send_s) * 1000.0


def e2e_ms(r: RequestRecord) -> float:
    return (r.end_s - r.send_s) * 1000.0


def tpot_ms(r: RequestRecord) -> float | None:
    """Time per output token after the first: (e2e - ttft) / (tokens - 1); None for one token."""
    if r.output_tokens < 2:
        return None
    return (e2e_ms(r) - ttft_ms(r)) / (r.output_tokens - 1)


def itl_ms(r: RequestRecord) -> list[float]:
    """Inter-token latencies: each chunk's gap after the previous one, spread evenly over its tokens."""
    out: list[float] = []
    for k in range(1, len(r.chunk_s)):
        gap, n = (r.chunk_s[k] - r.chunk_s[k - 1]) * 1000.0, r.chunk_tokens[k]
        out += [gap / n] * n
    return out


def meets_slo(r: RequestRecord, slo: SLO) -> bool:
    t = tpot_ms(r)
    return ttft_ms(r) <= slo.ttft_ms and (t is None or t <= slo.tpot_ms)


def migration_share(r: RequestRecord) -> float:
    """Server-side migration ms over client TTFT (0 when the request was not migrated)."""
    return (r.migration_ms or 0.0) / ttft_ms(r) if ttft_ms(r) > 0 else 0.0


def present(recs: list[RequestRecord], name: str) -> list[float]:
    """The values of field `name` the records have (None ones left out)."""
    return [getattr(r, name) for r in recs if getattr(r, name) is not None]


def mean_or_none(v: list[float]) -> float | None:
    """The mean, or None for no values (the JSON report never holds NaN)."""
    return float(np.mean(v)) if v else None


def _median(v: list[float]) -> float | None:
    return float(np.median(v)) if v else None


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO) -> dict:
    """One run's metrics from client records (only completed requests enter the latencies)."""
    done = [r for r in records if r.ok]
    ttft = [ttft_ms(r) for r in done]
    tpot = [t for t in (tpot_ms(r) for r in done) if t is not None]
    itl = [x for r in done for x in itl_ms(r)]
    e2e = [e2e_ms(r) for r in done]
    server_ttft, mig = present(done, "server_ttft_ms"), present(done, "migration_ms")
    streamed = [r for r in done if r.overlap_pct is not None]
    out_tokens = sum(r.output_tokens for r in done)
    told = [r for r in done if r.cached_tokens is not None]
    dur = max(duration_s, 1e-9)
    good = sum(meets_slo(r, slo) for r in done)
    res = {
        "completed": len(done), "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration": duration_s,
        "ttft_ms": percentiles(ttft), "tpot_ms": percentiles(tpot), "itl_ms": percentiles(itl),
        "e2e_ms": percentiles(e2e), "server_ttft_ms": percentiles(server_ttft),
        "throughput_tok_s": out_tokens / dur, "goodput_req_s": good / dur,
        "slo_attainment": good / len(records) if records else None,
        "migration_ms": percentiles(mig), "migrated": len(mig),
        "migration_share_of_ttft": percentiles([migration_share(r) for r in done]),
        # streamed migrations (KV shipped while the prompt was still prefilling): how many, the %
        # of each one's payload sent before its prefill finished, and the ms left after it
        "streamed_migrations": len(streamed), "overlap_pct": percentiles(present(streamed, "overlap_pct")),
        "exposed_ms": percentiles(present(streamed, "migration_ms")),
        "streamed_ms": percentiles(present(streamed, "streamed_ms")),
        # the same quantities under vLLM `bench serve`'s result-file names
        "total_input_tokens": sum(r.prompt_tokens for r in done), "total_output_tokens": out_tokens,
        # the share of prompt tokens the prefix cache gave (requests whose response said; None: none did)
        "prefix_hit_share": (sum(r.cached_tokens for r in told) / max(1, sum(r.prompt_tokens for r in told))
                             if told else None),
        "request_throughput": len(done) / dur, "output_throughput": out_tokens / dur,
        "request_goodput": good / dur,
    }
    for name, vals in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2e)):
        res[f"mean_{name}_ms"] = mean_or_none(vals)
        res[f"median_{name}_ms"] = _median(vals)
        res[f"p99_{name}_ms"] = percentiles(vals)["p99"]
    return res
