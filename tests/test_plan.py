"""pdserve plan (planner): the discrete-event model against hand-computed cases, and the two
hand-checkable verdicts (do not disaggregate: migration dominates short prompts; disaggregate:
long prompts' chunks stretch the decode steps they share under a tight TPOT SLO). No cluster."""

from __future__ import annotations

from dataclasses import replace

import pytest

from measure.serve_metrics import SLO
from planner.des import SimConfig, simulate
from planner.metrics import summarize
from planner.model import from_profile, synthetic
from planner.search import Target, plan
from planner.workload import Req, from_distributions, parse_dist


def test_single_request_first_token_at_prefill_then_migration():
    m = synthetic(prefill_fixed_ms=2.0, prefill_ms_per_token=0.05, decode_fixed_ms=1.0, decode_ms_per_seq=0.5,
                  migration_fixed_ms=3.0, migration_ms_per_token=0.01)
    (o,) = simulate([Req(0, 0.0, 100, 5)], m, SimConfig(prefill=1, decode=1))
    assert o.path == "disaggregate"
    # the prefill worker streams the first token at once; the KV then migrates (3 + 1 ms) before
    # four more tokens, one decode step (batch 1) each
    assert o.first_s * 1e3 == pytest.approx(m.prefill_ms(100)) == pytest.approx(2 + 5)
    assert (o.end_s - o.first_s) * 1e3 == pytest.approx(m.migration_ms(100) + 4 * 1.5)
    (one,) = simulate([Req(0, 0.0, 100, 1)], m, SimConfig(prefill=1, decode=1))  # max_tokens=1: no migration
    assert one.end_s == one.first_s == pytest.approx(7e-3)
    (c,) = simulate([Req(0, 0.0, 100, 5)], m, SimConfig(colocated=1))
    assert c.first_s * 1e3 == pytest.approx(7.0)


def test_serving_overheads_are_added():
    # the profile's serving path: +10 ms per request (disaggregated), +2 ms per later token
    m = synthetic(prefill_fixed_ms=2.0, prefill_ms_per_token=0.05, decode_fixed_ms=1.0, decode_ms_per_seq=0.5,
                  migration_fixed_ms=3.0, migration_ms_per_token=0.01, request_overhead_ms=10.0,
                  token_overhead_ms=2.0)
    (o,) = simulate([Req(0, 0.0, 100, 5)], m, SimConfig(prefill=1, decode=1))
    assert o.first_s * 1e3 == pytest.approx(m.prefill_ms(100) + 10.0)
    assert (o.end_s - o.first_s) * 1e3 == pytest.approx(m.migration_ms(100) + 4 * (1.5 + 2.0))
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
    assert summarize([a, b], SLO())["prefix_hit_share"] == pytest.approx(64 / 160)


def _plan(model, prompt, output, slo, rates, n=40):
    def at(rate):
        return from_distributions(prompt, output, rate, n, seed=1)
    return plan(at, model, [2], rates, Target(slo, 0.9), SimConfig(), median_prompt=prompt.mean)[2]


def test_short_prompts_do_not_disaggregate_migration_dominates():
    # 32-token prompts prefill in 1.3 ms; a migration costs 200 ms: the second of 16 tokens comes
    # 200 ms after the first, so TPOT > 200 / 15 ms, beyond the 10 ms TPOT SLO
    m = synthetic(prefill_fixed_ms=1.0, prefill_ms_per_token=0.01, migration_fixed_ms=200.0)
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


def test_fit_ttft_recovers_a_per_token_and_cold_term():
    from planner.serving import ServingPath, fit_ttft

    truth = ServingPath(request_ms=3.0, request_ms_per_token=0.004, request_ms_per_prompt_token=0.002,
                        cold_ms=6.0, cold_tau_ms=40.0)
    rows = []
    for tokens, computed in ((16, 16), (128, 128), (512, 512), (1024, 1024), (512, 16), (1024, 16)):
        for gap in (0.0, 20.0, 60.0, 300.0):
            for jitter in (-0.2, 0.0, 0.2):
                idle = 1.0 if gap == 0 else gap + 5.0
                rows.append({"tokens": tokens, "computed": computed, "gap_ms": gap, "idle_ms": idle,
                             "resid_ms": truth.ttft_ms(computed, tokens, idle) + jitter})
    rows.append({"tokens": 16, "gap_ms": 0.0, "idle_ms": 1.0, "resid_ms": 90.0})  # a descheduled one
    f = fit_ttft(rows)
    assert f["request_ms"] == pytest.approx(3.0, abs=0.3)
    assert f["request_ms_per_token"] == pytest.approx(0.004, abs=3e-4)
    assert f["request_ms_per_prompt_token"] == pytest.approx(0.002, abs=3e-4)
    assert f["cold_ms"] == pytest.approx(6.0, abs=0.3) and f["cold_tau_ms"] == 40.0
    # no idle spread and a falling residual: no cold term, the per-token slope clamped to 0
    flat = fit_ttft([{"tokens": t, "gap_ms": 0.0, "idle_ms": 1.0, "resid_ms": 5.0 - 0.001 * t}
                     for t in (16, 512)])
    assert flat["cold_ms"] == 0.0
    assert flat["request_ms_per_token"] == flat["request_ms_per_prompt_token"] == 0.0
    assert flat["request_ms"] == pytest.approx(5.0 - 0.001 * 264)


def test_profiles_with_older_or_no_serving_fields_load():
    base = {"prefill_fixed_ms": 1, "prefill_ms_per_token": 0, "decode_step_fixed_ms": 1,
            "decode_ms_per_sequence": 0, "migration_fixed_ms": 0, "migration_ms_per_byte": 0}
    none = from_profile({"fits": base})  # --no-serving
    assert none.serving("colocated").ttft_ms(500, 500, 1e9) == 0.0
    old = from_profile({"fits": {**base, "request_overhead_ms": {"colocated": 4.0, "disaggregated": None},
                                 "token_overhead_ms": {"colocated": 0.5}}})
    assert old.serving("colocated").ttft_ms(500, 500, 1e9) == 4.0
    assert old.token_overhead_ms("colocated") == 0.5
    assert old.serving("disaggregated").ttft_ms(500, 500, 1e9) == 0.0
    new = from_profile({"fits": {**base, "request_overhead_ms": {"colocated": 99.0}, "serving": {
        "colocated": {"request_ms": 2.0, "request_ms_per_token": 0.01, "token_ms": 0.3, "cold_ms": 5.0,
                      "cold_tau_ms": 50.0, "rms_ms": 0.4}}}})
    c = new.serving("colocated")  # the new fields win over the older constant; extra keys ignored
    assert c.ttft_ms(100, 400, 0.0) == pytest.approx(3.0) and c.ttft_ms(100, 400, 1e9) == pytest.approx(8.0)
    assert new.overhead_colocated_ms == 2.0 and new.token_overhead_colocated_ms == 0.3


def test_cold_cost_after_idle_and_per_computed_token():
    from planner.serving import ServingPath

    path = ServingPath(request_ms=1.0, request_ms_per_token=0.1, request_ms_per_prompt_token=0.01,
                       cold_ms=10.0, cold_tau_ms=1e-9)
    m = synthetic(prefill_fixed_ms=0.0, prefill_ms_per_token=0.1, decode_fixed_ms=1.0, decode_ms_per_seq=0.0,
                  serving=path)
    # 0: first (idle since ever: cold); 1: while 0 decodes (warm); 2: after a long idle (cold),
    # sharing 0's 32-token prefix: only its 16 computed tokens pay per token
    reqs = [Req(0, 0.0, 48, 20, "x", 32), Req(1, 0.005, 16, 2), Req(2, 5.0, 48, 2, "x", 32)]
    a, b, c = simulate(reqs, m, SimConfig(colocated=1))
    ttft = [(o.first_s - o.req.arrival_s) * 1e3 for o in (a, b, c)]
    assert a.idle_ms == float("inf") and b.idle_ms == 0.0 and c.idle_ms > 4000
    assert c.computed_tokens == 16 and a.computed_tokens == 48
    assert ttft[0] == pytest.approx(4.8 + 1.0 + 4.8 + 0.48 + 10.0)
    assert ttft[2] == pytest.approx(1.6 + 1.0 + 1.6 + 0.48 + 10.0)
    # no cold part; it waits for 0's step, whose serving work (1 + 4.8 + 0.48) runs in it, then
    # shares a step with 0's first decode (1.0) carrying its own prefill and serving work
    assert ttft[1] == pytest.approx((4.8 + 6.28) - 5.0 + 1.0 + 1.6 + (1.0 + 1.6 + 0.16))


def test_the_cold_cost_follows_the_engine_a_request_lands_on():
    """Idle is per engine: a request routed to an idle worker while another one decodes pays the
    cold part (the cluster as a whole is busy); one queued on the decoding worker does not."""
    from planner.serving import ServingPath

    path = ServingPath(cold_ms=10.0, cold_tau_ms=1e-9)
    m = synthetic(prefill_fixed_ms=0.0, prefill_ms_per_token=0.1, decode_fixed_ms=1.0, decode_ms_per_seq=0.0,
                  serving=path)
    # prefix_aware: 0 -> A; 1 (no prefix) -> B, the one with more free blocks; 2 -> A, caching its prefix
    reqs = [Req(0, 0.0, 64, 400, "x", 48), Req(1, 0.1, 16, 2), Req(2, 0.2, 64, 2, "x", 48)]
    a, b, c = simulate(reqs, m, SimConfig(colocated=2, num_blocks=256, routing="prefix_aware"))
    assert c.computed_tokens == 16  # it did land on A
    assert a.idle_ms == float("inf") and b.idle_ms == float("inf") and c.idle_ms == 0.0
    assert b.busy_engines == 1  # engine A was stepping: the cluster was not idle
    ttft = [(o.first_s - o.req.arrival_s) * 1e3 for o in (b, c)]
    assert ttft[0] == pytest.approx(1.6 + 10.0)  # alone on B: its prefill, then the cold part
    assert ttft[1] < 10.0  # on A, which decodes: warm (before, both were warm: A was stepping)


def test_a_prefill_chunk_that_ends_no_prompt_sends_no_report():
    """runtime.loop reports after a step only when it produced events (or the heartbeat is due):
    after the first 512-token chunk of a 1024-token prompt on engine 0, the router still sees
    engine 0 as it was before the prompt, a tie, and sends a short request there, behind the
    second chunk (with a report after every step it went to the idle engine 1)."""
    m = synthetic(prefill_fixed_ms=0.0, prefill_ms_per_token=0.1, decode_fixed_ms=1.0, decode_ms_per_seq=0.0)
    reqs = [Req(0, 0.0, 1024, 2), Req(1, 0.060, 16, 2)]  # 1 arrives during the second chunk (51.2..102.4 ms)
    long, short = simulate(reqs, m, SimConfig(colocated=2, num_blocks=256))
    assert (long.engine, short.engine) == ("colocated0", "colocated0")
    # its 16 tokens (1.6 ms) in the step after the second chunk, beside the long prompt's decode row (1 ms)
    assert (short.first_s - 0.060) * 1e3 == pytest.approx(102.4 - 60.0 + 1.6 + 1.0)
    # a heartbeat's worth later the report is due even after a silent step: request 1 sees the
    # prompt's blocks on engine 0 and goes to engine 1
    reqs = [Req(0, 0.0, 4096, 2), Req(1, 0.260, 16, 2)]  # chunks end at 51.2, 102.4, ..., 409.6 ms
    _, late = simulate(reqs, m, SimConfig(colocated=2, num_blocks=512))
    assert late.engine == "colocated1"


def test_least_loaded_routing_and_local_prefill_pays_the_colocated_path():
    from planner.serving import ServingPath

    m = synthetic(prefill_fixed_ms=0.0, prefill_ms_per_token=1.0, migration_fixed_ms=1.0)
    m = replace(m, colocated=ServingPath(request_ms=2.0), disaggregated=ServingPath(request_ms=7.0))
    # least loaded (ClusterConfig's default): the engine with more free blocks, not the one caching
    # the prefix (engine 0, still decoding request 0); prefix_aware: the cached one
    reqs = [Req(0, 0.0, 64, 1500, "x", 48), Req(1, 1.0, 64, 2, "x", 48)]
    ll = simulate(reqs, m, SimConfig(colocated=2, num_blocks=256))
    pa = simulate(reqs, m, SimConfig(colocated=2, num_blocks=256, routing="prefix_aware"))
    assert (ll[1].computed_tokens, pa[1].computed_tokens) == (64, 16)
    assert (ll[1].first_s - 1.0) * 1e3 > (pa[1].first_s - 1.0) * 1e3 + 40
    auto = SimConfig(prefill=1, decode=1, decide="auto")
    out = simulate([Req(0, 0.0, 20, 2), Req(1, 1.0, 400, 2)], m, auto)
    assert [o.path for o in out] == ["local_prefill", "disaggregate"]
    assert out[0].first_s * 1e3 == pytest.approx(20 + 2.0)
    assert (out[1].first_s - 1.0) * 1e3 == pytest.approx(400 + 7.0)


def test_routing_reads_the_last_report_and_the_loop_occupies_the_engine():
    m = synthetic(prefill_fixed_ms=0.0, prefill_ms_per_token=0.1, decode_fixed_ms=1.0, decode_ms_per_seq=0.0,
                  token_overhead_ms=2.0)
    # two requests at the same instant: the router has no report of the first yet, so both go to
    # the first engine (a tie), and the second waits for the first's 100 ms prefill
    a, b = simulate([Req(0, 0.0, 1000, 2), Req(1, 0.0, 10, 2)], m, SimConfig(colocated=2))
    assert b.first_s * 1e3 == pytest.approx(100 + 1.0)
    # later, the first engine's report shows it holding blocks: the next goes to the second engine
    c = simulate([Req(0, 0.0, 1000, 50), Req(1, 0.2, 10, 2)], m, SimConfig(colocated=2))[1]
    assert (c.first_s - 0.2) * 1e3 == pytest.approx(1.0)
    # the per-token cost is the decoding loop's own time: each decode step takes 1 + 2 ms, and a
    # prompt arriving mid-step waits for it, then shares the next step (1 + 10 * 0.1 + 2 ms)
    (d,) = simulate([Req(0, 0.0, 10, 5)], m, SimConfig(colocated=1))
    assert (d.end_s - d.first_s) * 1e3 == pytest.approx(4 * 3.0)
    e = simulate([Req(0, 0.0, 10, 5), Req(1, 0.0015, 10, 2)], m, SimConfig(colocated=1))[1]
    assert (e.first_s - 0.0015) * 1e3 == pytest.approx((4.0 - 1.5) + (1.0 + 1.0 + 2.0))


def test_validate_ranking_pairs_and_errors():
    from planner.validate import _err, _pairs

    pairs = _pairs({"a": 10.0, "b": 9.0, "c": 9.9}, {"a": 5.0, "b": 6.0, "c": 4.0})
    assert [(p["pair"], round(p["measured_gap"], 2), p["same_order"]) for p in pairs] == [
        (["a", "b"], 0.1, False), (["a", "c"], 0.01, True), (["b", "c"], -0.09, False)]
    assert _err(12.5, 10.0) == pytest.approx(0.25) and _err(None, 1.0) is None and _err(1.0, 0.0) is None


def test_validate_counts_only_the_pairs_its_measurement_separates():
    from planner.validate import _pairs, ranking_matches

    # 40 requests in 4 s at each of two rates; "a" met its SLOs 38 times, "b" 20, "c" 37
    def runs(good):
        return {rate: ([True] * good + [False] * (40 - good), 4.0) for rate in (5.0, 10.0)}

    flags = {"a": runs(38), "b": runs(20), "c": runs(37)}
    measured = {k: sum(sum(f) / d for f, d in r.values()) for k, r in flags.items()}  # 19, 10, 18.5 req/s
    pairs = {tuple(p["pair"]): p for p in _pairs(measured, {"a": 1.0, "b": 0.5, "c": 1.2}, flags)}
    assert pairs["a", "b"]["significant"] and pairs["b", "c"]["significant"]
    assert not pairs["a", "c"]["significant"]  # 38 vs 37 of 40: a tie
    lo, hi = pairs["a", "b"]["gap_ci"]
    assert 0 < lo < pairs["a", "b"]["measured_gap"] < hi
    assert ranking_matches(list(pairs.values()))  # a and c predicted the other way round: a tie
    flipped = _pairs(measured, {"a": 1.0, "b": 1.1, "c": 1.2}, flags)  # b above a: separated, wrong
    assert not ranking_matches(flipped)


def test_a_goodput_gap_from_wall_clock_alone_is_a_tie():
    """Every request met its SLOs in both runs; one merely ended 10 ms later, so its goodput reads
    0.2% lower. The flags cannot tell the two apart: a tie, not a separated pair (an unpaired
    bootstrap over the flags alone saw no spread at all and called the gap real)."""
    from planner.validate import _pairs

    flags = {"a": {10.0: ([True] * 60, 6.00)}, "b": {10.0: ([True] * 60, 6.01)}}
    measured = {k: sum(sum(f) / d for f, d in r.values()) for k, r in flags.items()}
    [pair] = _pairs(measured, {"a": 2.0, "b": 1.0}, flags)
    assert pair["measured_gap"] > 0 and pair["gap_ci"] == [0.0, 0.0] and not pair["significant"]
    # the same requests, five of them missing their SLO in b only: separated, paired request by request
    flags["b"] = {10.0: ([True] * 55 + [False] * 5, 6.01)}
    measured["b"] = 55 / 6.01
    [pair] = _pairs(measured, {"a": 2.0, "b": 1.0}, flags)
    assert pair["significant"] and pair["gap_ci"][0] > 0


def test_serving_stretch_from_free_cores():
    fits = {"prefill_fixed_ms": 1, "prefill_ms_per_token": 0, "decode_step_fixed_ms": 1,
            "decode_ms_per_sequence": 0, "migration_fixed_ms": 0, "migration_ms_per_byte": 0}
    quiet = from_profile({"fits": {**fits, "contention": 0.0}, "machine": {"cores": {"affinity": 2}}})
    assert quiet.free_cores() == 2 and [quiet.serving_stretch(k) for k in (0, 1, 2, 3)] == [1, 1, 1.5, 2]
    busy = replace(quiet, contention=1.0)  # two engines ran twice as slow as one: one core was free
    assert busy.free_cores() == 1 and [busy.serving_stretch(k) for k in (0, 1, 2)] == [1, 2, 3]
    assert from_profile({"fits": fits}).serving_stretch(5) == 1.0  # cores unknown: no stretch


@pytest.mark.parametrize("preset", [None, "short-prompt-long-output"])
def test_resimulate_predicts_a_saved_validation_again(preset):
    # a saved `plan --validate` (two cells; one kept its per-request SLO flags, one predates them):
    # the measured cells stay as they were, the predictions are the new model's on the very
    # requests bench serve sent for that seed and preset (saves without one ran "mixed")
    from measure.serve import _requests
    from planner.metrics import summarize
    from planner.validate import SETUPS, _serve_config, resimulate
    from planner.workload import from_specs

    m = synthetic(prefill_fixed_ms=1.0, prefill_ms_per_token=0.02, decode_fixed_ms=1.0, decode_ms_per_seq=0.1)
    cell = {"ttft_p50": 20.0, "ttft_p99": 40.0, "tpot_p50": 2.0, "tpot_p99": 3.0, "goodput": 1.5}
    sc = {"rates": [2.0], "num_requests": 12, **({"preset": preset} if preset else {})}
    saved = {"serve_config": sc, "slo": {"ttft_ms": 50.0, "tpot_ms": 5.0},
             "rows": [{"mode": "colocated", "rate": 2.0, "measured": cell, "slo_met": [True] * 12,
                       "duration": 6.0},
                      {"mode": "disaggregated", "rate": 2.0, "measured": {**cell, "goodput": 1.0}}],
             "unloaded": {"colocated": {"measured_ttft_p50": 10.0}}}
    v = resimulate(m, saved, contention=0.5)
    cfg = _serve_config([2.0], 12, SLO(ttft_ms=50.0, tpot_ms=5.0), preset or "mixed")
    reqs = from_specs(_requests(cfg, 2.0, 12, cfg.seed + 1))
    other = _serve_config([2.0], 12, SLO(), "mixed" if preset else "short-prompt-long-output")
    assert [r.prompt_tokens for r in reqs] != [r.prompt_tokens for r in
                                                 from_specs(_requests(other, 2.0, 12, other.seed + 1))]
    for row in v["rows"]:
        sim = replace(SETUPS[row["mode"]], step_budget=cfg.step_budget, block_size=cfg.block_size,
                      num_blocks=cfg.num_blocks)
        direct = summarize(simulate(reqs, m, sim), cfg.slo)
        assert row["predicted"]["ttft_p50"] == pytest.approx(direct["ttft_ms"]["p50"])
        assert row["error"]["ttft_p50"] == pytest.approx(direct["ttft_ms"]["p50"] / 20.0 - 1)
    assert [r["measured"]["goodput"] for r in v["rows"]] == [1.5, 1.0]
    assert v["unloaded"]["colocated"]["measured_ttft_p50"] == 10.0
    assert v["ranking"]["measured"] == ["colocated 2", "1P+1D"]
    assert "gap_ci" not in v["ranking"]["pairs"][0]  # one cell without flags: no bootstrap


def test_serving_cpu_beside_the_engines_stretches_their_steps():
    """Two engines on two cores with the serving processes using 0.8 of a core: steps run 2.8 / 2 =
    1.4x as long while both engines step, not at all longer while one does; the measured engine
    contention wins where it is the larger. In the simulation: one engine on one core, under a
    workload whose rate times the CPU per request is half a core, decodes 1.5x slower."""
    base = replace(synthetic(decode_fixed_ms=10.0, decode_ms_per_seq=0.0), cores=2)
    assert base.stretch(1, 0.8) == pytest.approx(1.4)
    assert base.stretch(0, 0.8) == pytest.approx(1.0)
    assert replace(base, contention=0.5).stretch(1, 0.8) == pytest.approx(1.5)
    assert replace(base, cores=0).stretch(1, 0.8) == pytest.approx(1.0)  # machine unknown: no stretch

    def tpot(cpu_ms: float) -> float:
        m = replace(base, cores=1, colocated=replace(base.colocated, cpu_ms=cpu_ms))
        reqs = [Req(0, 0.0, 16, 40), Req(1, 0.1, 16, 40)]  # 10 req/s
        o = next(o for o in simulate(reqs, m, SimConfig(colocated=1)) if o.req.index == 0)
        return (o.end_s - o.first_s) / 39

    assert tpot(50.0) / tpot(0.0) == pytest.approx(1.5)  # 10 req/s x 50 ms = half a core


def test_ttft_per_prompt_class_on_the_same_requests():
    # measured [prompt, cached, TTFT ms] per request beside the simulated outcomes of the same ones:
    # the class is the measured computed length (prompt - cached) against the threshold (80)
    from types import SimpleNamespace

    from planner.validate import by_class, format_validate

    def out(arrival, first):
        return SimpleNamespace(req=SimpleNamespace(arrival_s=arrival), first_s=first)

    measured = [[50, 0, 10.0], [500, 0, 40.0], [600, 550, 12.0], [40, 0, None], [90, 0, 30.0]]
    outcomes = [out(0.0, 0.009), out(1.0, 1.050), out(2.0, 2.013), out(3.0, 3.001), out(4.0, None)]
    cls = by_class(measured, outcomes, 80)
    # short: requests 0 and 2 (50 computed each); 3 never answered, 4 never predicted: both left out
    assert cls["short"]["n"] == 2 and cls["short"]["measured_p50"] == pytest.approx(11.0)
    assert cls["short"]["predicted_p50"] == pytest.approx(11.0)
    assert cls["short"]["error"] == pytest.approx(0.0)
    assert cls["short"]["paired_ms"] == pytest.approx(0.0)  # -1 and +1 ms: the median of the two
    assert cls["long"] == pytest.approx({"n": 1, "measured_p50": 40.0, "predicted_p50": 50.0, "error": 0.25,
                                         "paired_ms": 10.0})
    assert by_class(None, outcomes, 80) is None  # a saved validation without per-request records
    cell = {"ttft_p50": 20.0, "ttft_p99": 40.0, "tpot_p50": 2.0, "tpot_p99": 3.0, "goodput": 1.5}
    row = {"config": "colocated 2", "rate": 10.0, "measured": cell, "predicted": cell,
           "predicted_contention": cell, "by_class": cls}
    v = {"contention": 0.0, "rows": [row],
         "within_25pct": {"ttft_p50": 1, "tpot_p50": 1, "of": 1, "ttft_p50_by_class": 2, "of_classes": 2},
         "unloaded": {}, "ranking": {"measured": [], "predicted": [], "match": True, "measured_tied": False}}
    text = format_validate(v)
    assert "TTFT p50 per prompt class 2/2" in text
    assert "colocated 2 @ 10: TTFT p50 measured / predicted per class: short (2) 11.0 / 11.0" in text
    assert "long (1) 40.0 / 50.0 +25%, paired +10.0 ms" in text


def test_simulated_auto_weighs_the_decode_batch_as_the_cluster_does():
    # four sequences decoding on the decode worker: a 60-token prompt (<= 80 alone) would stall all
    # four, so auto's limit is 80 / 4 = 20 and it is migrated; the same prompt on an idle decode
    # worker is prefilled there
    m = synthetic(prefill_fixed_ms=0.0, prefill_ms_per_token=0.1, decode_fixed_ms=1.0, decode_ms_per_seq=0.1)
    auto = SimConfig(prefill=1, decode=1, decide="auto", local_prefill_max_tokens=80, num_blocks=512)
    busy = [Req(i, 0.0, 10, 400) for i in range(4)] + [Req(4, 0.5, 60, 2)]
    out = simulate(busy, m, auto)
    assert [o.path for o in out[:4]] == ["local_prefill"] * 4
    assert (out[4].path, out[4].reason_kind) == ("disaggregate", "long_uncached")
    alone = simulate([Req(0, 0.0, 60, 2)], m, auto)
    assert alone[0].path == "local_prefill"
