"""planner.profile_serving without a cluster: the measured request shapes and the isolated requests'
schedule, the idle time before each request from client records, and the rows
planner.serving.fit_ttft fits, on records made by hand from a known serving path."""

from __future__ import annotations

import numpy as np
import pytest

from measure.loadgen import RequestRecord
from planner.model import synthetic
from planner.profile_serving import OWN, _idle, _rows, _run_s, back_to_back, isolated, shapes
from planner.serving import ServingPath, fit_ttft


def test_shapes_and_isolated_schedule_leave_the_planned_gap_after_each_expected_end():
    assert shapes((16, 64, 100), 16) == [(16, 0), (64, 0), (100, 0), (64, 48), (100, 80)]
    rng, base, run_s = np.random.default_rng(0), list(range(40, 140)), {16: 0.05, 100: 0.2}
    specs, gaps, cached = isolated([(16, 0), (100, 80)], (20, 300), 2, 8, rng, 100, run_s, base)
    assert len(specs) == 8 and sorted(gaps.values()) == [20.0] * 4 + [300.0] * 4
    assert [s.index for s in specs] == list(range(100, 108))
    t = 0.0
    for s in specs:  # each arrival: the previous one's expected end plus its own gap
        t += gaps[s.index] / 1e3
        assert s.arrival_s == pytest.approx(t)
        t += run_s[len(s.prompt)]
        if cached[s.index]:  # the shared prefix, then its own tokens
            assert s.prompt[:100 - OWN] == base[:100 - OWN] and len(s.prompt) == 100
    specs, cached = back_to_back([(16, 0), (64, 48)], 4, 2, rng, 0, base)
    assert [len(s.prompt) for s in specs] == [16, 16, 64, 64] and list(cached.values()) == [0, 0, 48, 48]


def _record(index, tokens, send, ttft_ms, out=8, step_ms=2.0, server_ms=None):
    first = send + ttft_ms / 1e3
    end = first + (out - 1) * step_ms / 1e3
    return RequestRecord(index, tokens, out, send_s=send, first_s=first, end_s=end, output_tokens=out,
                         ok=True, server_ttft_ms=server_ms)


def test_idle_rows_and_fit_recover_the_serving_path():
    model = synthetic(prefill_fixed_ms=1.0, prefill_ms_per_token=0.02, decode_fixed_ms=1.0,
                      decode_ms_per_seq=0.0)
    truth = ServingPath(request_ms=2.0, request_ms_per_token=0.005, request_ms_per_prompt_token=0.002,
                        cold_ms=5.0, cold_tau_ms=80.0)
    records, gaps, cached, t, i = [], {}, {}, 100.0, 0
    for gap in (0.0, 20.0, 60.0, 300.0):
        for tokens, hit in ((16, 0), (128, 0), (512, 0), (512, 496)):
            for _ in range(2):
                idle = 0.5 if gap == 0 else gap
                t += idle / 1e3
                ttft = model.prefill_ms(tokens - hit) + truth.ttft_ms(tokens - hit, tokens, idle)
                records.append(_record(i, tokens, t, ttft, server_ms=ttft - 1.5))
                gaps[i], cached[i] = gap, hit
                t, i = records[-1].end_s, i + 1
    idle = _idle(list(reversed(records)))  # any order: by send time
    assert idle[0] > 1e5 and idle[1] == pytest.approx(0.5) and idle[len(records) - 1] == pytest.approx(300.0)
    rows = _rows(records, model, "colocated", gaps, idle, cached)
    assert all(r["client_ms"] == pytest.approx(1.5) for r in rows)
    assert {r["computed"] for r in rows} == {16, 128, 512}
    assert all(r["token_resid_ms"] == pytest.approx(2.0 - model.step_ms(1, r["tokens"] + 4, 0)) for r in rows)
    f = fit_ttft(rows[1:])  # the very first one idled since ever
    assert f["request_ms"] == pytest.approx(2.0, abs=0.05)
    assert f["request_ms_per_token"] == pytest.approx(0.005, abs=2e-4)
    assert f["request_ms_per_prompt_token"] == pytest.approx(0.002, abs=2e-4)
    assert f["cold_ms"] == pytest.approx(5.0, abs=0.1) and f["cold_tau_ms"] == 80.0
    run = _run_s(records)
    took = sorted(r.end_s - r.send_s for r in records if r.prompt_tokens == 16)
    assert run[16] == pytest.approx(1.25 * (took[3] + took[4]) / 2 + 0.003) and run[512] > run[16]
    overlapped = _idle([_record(0, 16, 1.0, 5.0), _record(1, 16, 1.001, 5.0)])
    assert overlapped[1] < 0  # sent before the previous answer ended: dropped from the fit


def test_disaggregated_rows_put_the_migration_in_tpot_not_ttft():
    model = synthetic(prefill_fixed_ms=1.0, prefill_ms_per_token=0.02, decode_fixed_ms=1.0,
                      decode_ms_per_seq=0.0, migration_fixed_ms=3.0, migration_ms_per_token=0.01)
    rec = _record(0, 100, 5.0, 10.0, out=5, step_ms=2.0)
    (row,) = _rows([rec], model, "disaggregated", {}, {0: 1.0}, {0: 50})
    assert row["computed"] == 50 and row["resid_ms"] == pytest.approx(10.0 - model.prefill_ms(50))
    mig = model.migration_ms(50)
    assert row["token_resid_ms"] == pytest.approx(2.0 - model.step_ms(1, 102, 0) - mig / 4)


def test_served_contention_is_the_median_pair_ratio_and_skips_a_pair_on_one_worker():
    from planner.profile_serving import contention_of

    def stream(index, step_ms, worker):
        r = _record(index, 128, 0.0, 5.0, out=11, step_ms=step_ms)
        r.worker = worker
        return r

    pairs = [(stream(0, 1.0, "c0"), [stream(1, 1.4, "c0"), stream(2, 1.6, "c1")]),   # 1.5x
             (stream(3, 2.0, "c0"), [stream(4, 2.2, "c0"), stream(5, 2.2, "c1")]),   # 1.1x
             (stream(6, 1.0, "c0"), [stream(7, 1.2, "c0"), stream(8, 1.2, "c1")]),   # 1.2x
             (stream(9, 1.0, "c0"), [stream(10, 1.05, "c0"), stream(11, 1.05, "c0")])]  # a batch of 2: out
    out = contention_of(pairs)
    assert out["ratios"] == pytest.approx([1.5, 1.1, 1.2])
    assert out["contention"] == pytest.approx(0.2) and out["same_worker"] == 1
    assert out["alone_tpot_ms"] == pytest.approx([1.0, 2.0, 1.0])
    faster = contention_of([(stream(0, 2.0, "c0"), [stream(1, 1.0, "c0"), stream(2, 1.0, "c1")])])
    assert faster["contention"] == 0.0  # noise that makes two streams faster is no negative contention
    failed = _record(20, 128, 0.0, 5.0)
    failed.ok = False
    assert contention_of([(failed, [stream(21, 1.0, "c0"), stream(22, 1.0, "c1")])])["contention"] is None
