"""pdserve plan (bench.plan): the discrete-event model against hand-computed cases, and the two
hand-checkable verdicts (do not disaggregate: migration dominates short prompts; disaggregate:
long prompts' chunks stretch the decode steps they share under a tight TPOT SLO). No cluster."""

from __future__ import annotations

import pytest

from bench.plan.des import SimConfig, simulate
from bench.plan.model import from_profile, synthetic
from bench.plan.search import Target, plan
from bench.plan.workload import Req, from_distributions, parse_dist
from bench.serve_metrics import SLO


def test_single_request_ttft_is_prefill_plus_migration():
    m = synthetic(prefill_fixed_ms=2.0, prefill_ms_per_token=0.05, decode_fixed_ms=1.0, decode_ms_per_seq=0.5,
                  migration_fixed_ms=3.0, migration_ms_per_token=0.01)
    (o,) = simulate([Req(0, 0.0, 100, 5)], m, SimConfig(prefill=1, decode=1))
    assert o.path == "disaggregate"
    assert (o.first_s * 1e3) == pytest.approx(m.prefill_ms(100) + m.migration_ms(100))
    assert m.prefill_ms(100) + m.migration_ms(100) == pytest.approx(2 + 5 + 3 + 1)
    # four more tokens, one decode step (batch 1) each
    assert (o.end_s - o.first_s) * 1e3 == pytest.approx(4 * 1.5)
    (c,) = simulate([Req(0, 0.0, 100, 5)], m, SimConfig(colocated=1))
    assert c.first_s * 1e3 == pytest.approx(7.0)


def test_serving_overheads_are_added():
    # the profile's serving path: +10 ms per request (disaggregated), +2 ms per later token
    m = synthetic(prefill_fixed_ms=2.0, prefill_ms_per_token=0.05, decode_fixed_ms=1.0, decode_ms_per_seq=0.5,
                  migration_fixed_ms=3.0, migration_ms_per_token=0.01, request_overhead_ms=10.0,
                  token_overhead_ms=2.0)
    (o,) = simulate([Req(0, 0.0, 100, 5)], m, SimConfig(prefill=1, decode=1))
    assert o.first_s * 1e3 == pytest.approx(m.prefill_ms(100) + m.migration_ms(100) + 10.0)
    assert (o.end_s - o.first_s) * 1e3 == pytest.approx(4 * (1.5 + 2.0))
    prof = {"fits": {"prefill_fixed_ms": 1, "prefill_ms_per_token": 0, "decode_step_fixed_ms": 1,
                     "decode_ms_per_sequence": 0, "migration_fixed_ms": 0, "migration_ms_per_byte": 0,
                     "request_overhead_ms": {"colocated": 4.0, "disaggregated": 9.0},
                     "token_overhead_ms": {"colocated": 0.5, "disaggregated": 2.5}, "contention": 0.3}}
    pm = from_profile(prof)
    assert pm.contention == 0.3 and from_profile(prof, 0.0).contention == 0.0
    (c,) = simulate([Req(0, 0.0, 10, 3)], pm, SimConfig(colocated=1))
    assert c.first_s * 1e3 == pytest.approx(1.0 + 4.0) and (c.end_s - c.first_s) * 1e3 == pytest.approx(3.0)
    assert pm.request_overhead_ms("disaggregated") == 9.0 and pm.token_overhead_ms("disaggregated") == 2.5


def test_memory_refusal_and_queueing():
    m = synthetic()
    # 4 blocks of 16 tokens: a 100-token request can never fit: refused, not queued forever
    out = simulate([Req(0, 0.0, 100, 4), Req(1, 0.0, 40, 8)], m, SimConfig(colocated=1, num_blocks=4))
    assert [o.path for o in out] == ["refused", "colocated"]
    assert out[1].end_s is not None
    # two 48-token requests, 3 blocks each, in a 4-block pool: the second waits for the first's blocks
    a, b = simulate([Req(0, 0.0, 40, 8), Req(1, 0.0, 40, 8)], m, SimConfig(colocated=1, num_blocks=4))
    assert b.first_s >= a.end_s


def test_shared_prefix_is_prefilled_once():
    m = synthetic(prefill_fixed_ms=0.0, prefill_ms_per_token=1.0)
    reqs = [Req(0, 0.0, 80, 2, "x", 64), Req(1, 1.0, 80, 2, "x", 64)]
    a, b = simulate(reqs, m, SimConfig(colocated=1))
    assert (a.first_s - a.req.arrival_s) * 1e3 == pytest.approx(80)
    assert (b.first_s - b.req.arrival_s) * 1e3 == pytest.approx(16)  # 4 cached blocks of 16


def _plan(model, prompt, output, slo, rates, n=40):
    def at(rate):
        return from_distributions(prompt, output, rate, n, seed=1)
    return plan(at, model, [2], rates, Target(slo, 0.9), SimConfig(), median_prompt=prompt.mean)[2]


def test_short_prompts_do_not_disaggregate_migration_dominates():
    # 32-token prompts prefill in 1.3 ms; a migration costs 30 ms, beyond the 20 ms TTFT SLO
    m = synthetic(prefill_fixed_ms=1.0, prefill_ms_per_token=0.01, migration_fixed_ms=30.0)
    res = _plan(m, parse_dist("fixed:32"), parse_dist("fixed:16"), SLO(ttft_ms=20, tpot_ms=10), (5.0, 20.0))
    v = res["verdict"]
    assert not v["disaggregate"] and v["reason_kind"] == "migration_cost", v
    assert res["best"] == "colocated 2"
    always = next(r for r in res["rows"] if r["config"] == "1P+1D")
    assert always["sustained_rate"] == 0 and all(p["slo_attainment"] == 0 for p in always["points"])
    auto = next(r for r in res["rows"] if r["config"] == "1P+1D auto")  # 32 <= 80: prefilled locally
    assert auto["points"][0]["paths"] == {"local_prefill/short_uncached": 40}


def test_long_prompts_tight_tpot_disaggregate_interference():
    # 2048-token prompts: four 512-token chunks of ~104 ms; 20 output tokens of 2 ms steps: a decode
    # that shares its engine with one chunk averages > 5 ms per token (TPOT SLO 5 ms)
    m = synthetic(prefill_fixed_ms=2.0, prefill_ms_per_token=0.2, decode_fixed_ms=2.0, decode_ms_per_seq=0.1,
                  migration_fixed_ms=1.0, migration_ms_per_token=0.001)
    res = _plan(m, parse_dist("fixed:2048"), parse_dist("fixed:20"), SLO(ttft_ms=3000, tpot_ms=5),
                (0.5, 1.0, 1.5))
    v = res["verdict"]
    assert v["disaggregate"] and v["reason_kind"] == "prefill_interference", v
    assert res["best"].startswith("1P+1D")
    colo = next(r for r in res["rows"] if r["config"] == "colocated 2")
    assert colo["points"][-1]["tpot_misses"] > colo["points"][-1]["ttft_misses"]
