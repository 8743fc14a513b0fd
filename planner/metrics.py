"""The planner's metrics over simulated outcomes, defined as measure.serve_metrics defines them for
measured runs: TTFT (first token - arrival), TPOT ((end - first) / (tokens - 1), none for one
token), their p50/p99 (numpy's linear interpolation), goodput (requests meeting both SLOs per
second of the run, the run lasting from the first arrival to the last completion) and attainment
(the share of all requests meeting both; refused or unfinished ones never do).
"""

from __future__ import annotations

from collections import Counter

from measure.serve_metrics import SLO, percentiles


def _ttft_ms(o) -> float:
    return (o.first_s - o.req.arrival_s) * 1e3


def _tpot_ms(o) -> float | None:
    if o.req.output_tokens < 2:
        return None
    return (o.end_s - o.first_s) * 1e3 / (o.req.output_tokens - 1)


def meets(o, slo: SLO) -> bool:
    if o.end_s is None:
        return False
    t = _tpot_ms(o)
    return _ttft_ms(o) <= slo.ttft_ms and (t is None or t <= slo.tpot_ms)


def summarize(outcomes: list, slo: SLO) -> dict:
    done = [o for o in outcomes if o.end_s is not None]
    ttft = [_ttft_ms(o) for o in done]
    tpot = [t for t in (_tpot_ms(o) for o in done) if t is not None]
    good = sum(meets(o, slo) for o in done)
    t0 = min((o.req.arrival_s for o in outcomes), default=0.0)
    dur = max((o.end_s for o in done), default=t0) - t0
    return {"requests": len(outcomes), "completed": len(done),
            "refused": sum(o.path == "refused" for o in outcomes),
            "ttft_ms": percentiles(ttft), "tpot_ms": percentiles(tpot),
            "ttft_misses": sum(_ttft_ms(o) > slo.ttft_ms for o in done),
            "tpot_misses": sum((_tpot_ms(o) or 0.0) > slo.tpot_ms for o in done),
            "goodput_req_s": good / dur if dur > 0 else float(good),
            "slo_attainment": good / len(outcomes) if outcomes else None,
            # the share of prompt tokens the prefix cache gave, as measure.serve_metrics counts it
            "prefix_hit_share": (sum(o.req.prompt_tokens - o.computed_tokens for o in done)
                                 / max(1, sum(o.req.prompt_tokens for o in done))),
            "paths": dict(Counter(f"{o.path}/{o.reason_kind}" if o.reason_kind else o.path
                                  for o in outcomes))}
