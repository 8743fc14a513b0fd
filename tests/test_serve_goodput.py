"""The goodput search (measure.serve_goodput) against hand-made attainment curves: it brackets the
rate where attainment falls below 90%, grows and shrinks to find it, stops within its tolerance or
its step budget, and its bootstrap interval holds the bracket; SLO scaling (measure.serve_slo)."""

from __future__ import annotations

import pytest

from measure import serve_goodput as sg
from measure import serve_slo
from measure.serve_metrics import SLO


def _curve(capacity: float, n: int = 40):
    """A server that meets every SLO up to `capacity` req/s and half of them above it."""
    calls = []

    def measure(rate: float, step: int) -> list[bool]:
        calls.append((rate, step))
        good = n if rate <= capacity else n // 2
        return [True] * good + [False] * (n - good)

    return measure, calls


def test_bisection_brackets_the_capacity():
    measure, calls = _curve(3.0)
    r = sg.search(measure, sg.SearchConfig(start_rate=1.0, steps=10, rel_tol=0.05))
    lo, hi = r["bracket"]
    assert lo <= 3.0 < hi and hi <= lo * 1.05 and r["converged"] and r["monotonic"]
    assert r["goodput_req_s"] == lo
    assert [c[0] for c in calls[:3]] == [1.0, 2.0, 4.0]         # doubles until one fails
    assert calls[3][0] == 3.0                                   # then bisects between 2 and 4
    assert [c[1] for c in calls] == list(range(len(calls)))     # each step its own seed index
    low, high = r["ci"]
    assert low <= lo and high >= hi                             # the bracket lies within the interval


def test_the_search_halves_when_the_start_fails_and_stops_at_its_step_budget():
    measure, calls = _curve(0.3)
    r = sg.search(measure, sg.SearchConfig(start_rate=2.0, steps=3))
    assert [c[0] for c in calls] == [2.0, 1.0, 0.5] and r["goodput_req_s"] == 0.0
    assert r["bracket"] == [None, 0.5] and not r["converged"]
    nothing, _ = _curve(0.0)
    floor = sg.search(nothing, sg.SearchConfig(start_rate=0.1, min_rate=0.05, steps=10))
    assert [s["rate"] for s in floor["steps"]] == [0.1, 0.05] and floor["goodput_req_s"] == 0.0


def test_the_search_stops_at_its_ceiling():
    measure, calls = _curve(100.0)
    r = sg.search(measure, sg.SearchConfig(start_rate=16.0, max_rate=64.0, steps=10))
    assert [c[0] for c in calls] == [16.0, 32.0, 64.0] and r["goodput_req_s"] == 64.0
    assert r["ci"][1] is None  # nothing failed: the interval is open above


def test_attainment_near_the_target_widens_the_interval():
    # 36/40 = 90% passes by a hair: the bootstrap cannot say it surely passes, so the interval's low
    # end drops to the last rate that surely did (all 40 met)
    table = {1.0: 40, 2.0: 36, 3.0: 34, 4.0: 10}
    r = sg.summarize_points({rate: [True] * k + [False] * (40 - k) for rate, k in table.items()},
                            sg.SearchConfig(), [])
    assert r["goodput_req_s"] == 2.0 and r["bracket"] == [2.0, 3.0]
    assert r["ci"] == [1.0, 4.0]  # 3.0 (85%) may still pass at 95%; 4.0 (25%) surely fails
    assert sg.tie([1.0, 4.0], [3.5, None]) and not sg.tie([1.0, 2.0], [2.5, 3.0])
    # touching ends: at 2.0 one surely passed and the other surely failed, so they are separated
    assert not sg.tie([2.0, 4.0], [1.0, 2.0]) and sg.tie([0.0, 2.0], [0.0, 4.0])


def test_non_monotonic_attainment_is_flagged():
    r = sg.summarize_points({1.0: [True] * 10, 2.0: [False] * 10, 3.0: [True] * 10}, sg.SearchConfig(), [])
    assert r["goodput_req_s"] == 1.0 and not r["monotonic"]


def test_bad_search_configs_are_refused():
    with pytest.raises(ValueError):
        sg.SearchConfig(start_rate=100.0, max_rate=64.0)
    with pytest.raises(ValueError):
        sg.SearchConfig(steps=0)


def test_slos_are_multiples_of_the_unloaded_times():
    scale = serve_slo.SLOScale(ttft=5.0, tpot=2.0)
    assert serve_slo.scaled(scale, SLO(), 120.0, 15.0) == SLO(ttft_ms=600.0, tpot_ms=30.0)
    half = serve_slo.SLOScale(ttft=None, tpot=3.0)  # TTFT fixed at the given ms
    assert serve_slo.scaled(half, SLO(ttft_ms=900.0), 120.0, 15.0) == SLO(ttft_ms=900.0, tpot_ms=45.0)
    with pytest.raises(ValueError, match="unloaded TPOT was not measured"):
        serve_slo.scaled(scale, SLO(), 120.0, None)
    rec = serve_slo.record(scale, SLO(600.0, 30.0), 120.0, 15.0, "colocated-128")
    assert rec == {"ttft_multiple": 5.0, "tpot_multiple": 2.0, "unloaded_ttft_ms": 120.0,
                   "unloaded_tpot_ms": 15.0, "measured_on": "colocated-128", "ttft_slo_ms": 600.0,
                   "tpot_slo_ms": 30.0}
    with pytest.raises(ValueError):
        serve_slo.SLOScale(ttft=0.0)


def test_run_length_estimate_from_the_unloaded_times():
    # 1 setup, 2 steps of 10 requests at 2 req/s; e2e 0.1 + 9 x 0.01 = 0.19 s; calibration 2 x (0.1 + 0.19)
    est = serve_slo.estimate_seconds(1, [2.0, 1.0], 10, 100.0, 10.0, 10.0, 2, start_s=30.0)
    assert est == pytest.approx(30.0 + 2 * 0.29 + (5.0 + 0.19) + (10.0 + 0.19))
    assert serve_slo.start_rate(2, 100.0, 10.0, 10.0, share=1.0) == pytest.approx(2 / 0.19)
    assert serve_slo.start_rate(2, 100.0, 10.0, 10.0) == pytest.approx(serve_slo.START_SHARE * 2 / 0.19)
    # the longest search halves from its start down to start / span, then stops
    assert serve_slo.slowest_rates(4.0, 6, 4.0) == [4.0, 2.0, 1.0]
    assert serve_slo.slowest_rates(4.0, 6, 3.0) == [4.0, 2.0, pytest.approx(4 / 3)]
    assert serve_slo.slowest_rates(4.0, 2, 8.0) == [4.0, 2.0]


def test_the_search_keeps_within_its_span_as_bench_serve_sets_it():
    from measure.serve import ServeBenchConfig, _search_config

    scfg = _search_config(ServeBenchConfig(search_span=4.0, search_steps=6), 2.0)
    assert (scfg.min_rate, scfg.max_rate, scfg.steps) == (0.5, 8.0, 6)
    measure, calls = _curve(0.1)
    r = sg.search(measure, scfg)
    assert [c[0] for c in calls] == [2.0, 1.0, 0.5] and r["bracket"] == [None, 0.5]
