"""The serving benchmark: load generation (seeded Poisson arrivals, length distributions,
presets), the metrics on hand-made request records against hand-computed values, one
end-to-end `pdserve bench serve --url` run against an in-process HTTP server over a
LocalEngineBackend with the tiny model (no Ray), and the setup plan (disaggregated streamed and
whole, colocated) run against the same server standing in for the clusters. The load client runs
in a child process in every end-to-end run; the report records its pid."""

from __future__ import annotations

import asyncio
import json
import os
import threading

import numpy as np
import pytest

from measure import serve as bs
from measure import serve_metrics as sm
from measure.loadgen import (
    PRESETS,
    PROMPT_ID_RANGE,
    LengthDist,
    RequestRecord,
    RequestSpec,
    Workload,
    arrival_times,
    make_requests,
    preset,
    run_load,
)

RUN_KEYS = {"mode", "rate", "completed", "failed", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms",
            "throughput_tok_s",
            "goodput_req_s", "migration_share_of_ttft", "streamed", "label", "client_pid",
            "streamed_migrations", "overlap_pct", "exposed_ms", "streamed_ms"}
VLLM_KEYS = {"mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
             "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms",
             "request_throughput", "output_throughput", "completed", "duration"}


# ---- load generation -----------------------------------------------------------------------
def test_poisson_arrivals_have_exponential_gaps_and_follow_the_seed():
    rate, n = 4.0, 20000
    t = arrival_times(rate, n, np.random.default_rng(7))
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
    gaps = np.diff(t)
    # mean 1/rate and coefficient of variation 1 (exponential); loose bounds (~6 sigma at n=20000)
    assert abs(gaps.mean() - 1 / rate) < 0.05 / rate
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05
    assert arrival_times(rate, 50, np.random.default_rng(7)) == t[:50]
    assert arrival_times(rate, 50, np.random.default_rng(8)) != t[:50]
    assert arrival_times(float("inf"), 3, np.random.default_rng(0)) == [0.0, 0.0, 0.0]


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert LengthDist("fixed", mean=37).sample(rng, 5) == [37] * 5
    u = LengthDist("uniform", low=3, high=6).sample(rng, 2000)
    assert set(u) == {3, 4, 5, 6}
    ln = LengthDist("lognormal", mean=200, low=50, high=400, sigma=0.5).sample(rng, 4000)
    assert min(ln) >= 50 and max(ln) <= 400 and min(ln) == 50 and max(ln) == 400  # clipped at both ends
    assert abs(np.median(ln) - 200) < 15
    for bad in ({"kind": "normal"}, {"low": 0}, {"low": 9, "high": 3}, {"sigma": -1.0}):
        with pytest.raises(ValueError):
            LengthDist(**bad)
    with pytest.raises(ValueError):
        Workload(rate=0.0, num_requests=1, prompt_len=LengthDist(), output_len=LengthDist())


def test_presets_and_requests_have_exact_lengths():
    from pdserve_cli.cmd_bench_serve import PRESETS as CLI_PRESETS

    assert set(CLI_PRESETS) == set(PRESETS) | {"mixed"}  # mixed: measure.serve_mixed
    assert set(PRESETS) == {"long-prompt-short-output", "short-prompt-long-output", "long-prompt-long-output"}
    means = {}
    for name in PRESETS:
        w = preset(name, rate=2.0, num_requests=200, seed=3)
        specs = make_requests(w)
        rng = np.random.default_rng(3)
        arrival_times(2.0, 200, rng)  # consume the same draws make_requests takes first
        plens, olens = w.prompt_len.sample(rng, 200), w.output_len.sample(rng, 200)
        assert [len(s.prompt) for s in specs] == plens and [s.max_tokens for s in specs] == olens
        assert all(PROMPT_ID_RANGE[0] <= x < PROMPT_ID_RANGE[1] for s in specs for x in s.prompt)
        assert make_requests(w) == specs and make_requests(preset(name, 2.0, 200, seed=4)) != specs
        means[name] = (np.mean(plens), np.mean(olens))
    lp, so = means["long-prompt-short-output"], means["short-prompt-long-output"]
    ll = means["long-prompt-long-output"]
    assert lp[0] > 5 * lp[1] and so[1] > so[0] and lp[0] > 5 * so[0]
    assert ll[0] > 5 * so[0] and ll[1] > so[1] > 5 * lp[1] / 2  # long prompts with the longest outputs
    assert all(p.high + o.high <= 2048 for p, o in PRESETS.values())  # within the tiny model's context
    with pytest.raises(ValueError):
        preset("nope", 1.0, 1)


# ---- metrics on hand-made records ------------------------------------------------------------
def _rec(i, send, chunks, ok=True, mig=None, max_tokens=None):
    toks = [n for _, n in chunks]
    r = RequestRecord(i, prompt_tokens=10, max_tokens=max_tokens or sum(toks), send_s=send, ok=ok,
                      migration_ms=mig)
    if ok:
        r.chunk_s, r.chunk_tokens = [t for t, _ in chunks], toks
        r.first_s, r.end_s, r.output_tokens = chunks[0][0], chunks[-1][0], sum(toks)
    else:
        r.error = "HTTP 503: gone"
    return r


def _records():
    a = _rec(0, 0.0, [(0.1, 1), (0.12, 1), (0.14, 1), (0.16, 1)], mig=10.0)  # ttft 100, tpot 20
    a.overlap_pct, a.streamed_ms = 80.0, 60.0  # a streamed migration: 10 ms exposed after 60 streamed
    b = _rec(1, 1.0, [(1.3, 1), (1.4, 2)], mig=30.0)  # ttft 300, e2e 400, 3 tokens: tpot 50, itl 50, 50
    c = _rec(2, 1.5, [], ok=False, max_tokens=4)
    d = _rec(3, 2.0, [(2.05, 1)])  # one token: ttft 50, no tpot
    a.cached_tokens, b.cached_tokens = 8, 0  # d's server said nothing: it does not count
    return [a, b, c, d]


def test_per_request_metrics():
    a, b, _, d = _records()
    assert sm.ttft_ms(a) == pytest.approx(100) and sm.e2e_ms(b) == pytest.approx(400)
    assert sm.tpot_ms(a) == pytest.approx(20) and sm.tpot_ms(b) == pytest.approx(50) and sm.tpot_ms(d) is None
    assert sm.itl_ms(a) == pytest.approx([20, 20, 20]) and sm.itl_ms(b) == pytest.approx([50, 50])
    assert sm.migration_share(a) == pytest.approx(0.1) and sm.migration_share(d) == 0.0
    slo = sm.SLO(ttft_ms=200, tpot_ms=30)
    assert [sm.meets_slo(r, slo) for r in (a, b, d)] == [True, False, True]
    assert not sm.meets_slo(a, sm.SLO(ttft_ms=200, tpot_ms=19))


def test_summarize_against_hand_computed_values():
    s = sm.summarize(_records(), duration_s=4.0, slo=sm.SLO(ttft_ms=200, tpot_ms=30))
    assert (s["completed"], s["failed"]) == (3, 1) and s["errors"] == ["HTTP 503: gone"]
    # ttft [100, 300, 50]: sorted [50, 100, 300]; p90 at rank 1.8 -> 100 + 0.8 * 200
    assert s["ttft_ms"]["p50"] == pytest.approx(100)
    assert s["ttft_ms"]["p90"] == pytest.approx(260) and s["ttft_ms"]["p99"] == pytest.approx(296)
    assert s["tpot_ms"]["p50"] == pytest.approx(35) and s["median_tpot_ms"] == pytest.approx(35)
    assert s["itl_ms"]["p50"] == pytest.approx(20) and s["mean_itl_ms"] == pytest.approx(32)
    assert s["mean_e2el_ms"] == pytest.approx((160 + 400 + 50) / 3)
    assert s["throughput_tok_s"] == pytest.approx(8 / 4) == s["output_throughput"]
    assert s["goodput_req_s"] == pytest.approx(2 / 4) == s["request_goodput"]
    assert s["request_throughput"] == pytest.approx(3 / 4) and s["duration"] == 4.0
    assert s["migration_share_of_ttft"]["p50"] == pytest.approx(0.1) and s["migrated"] == 2
    assert s["streamed_migrations"] == 1 and s["overlap_pct"]["p50"] == pytest.approx(80)
    assert s["exposed_ms"]["p99"] == pytest.approx(10) and s["streamed_ms"]["p50"] == pytest.approx(60)
    assert s["prefix_hit_share"] == pytest.approx(8 / 20)  # a and b: 8 of their 10 + 10 prompt tokens
    assert RUN_KEYS - {"mode", "rate", "streamed", "label", "client_pid"} <= set(s) and VLLM_KEYS <= set(s)
    empty = sm.summarize([_records()[2]], 1.0, sm.SLO())
    assert empty["completed"] == 0 and empty["ttft_ms"] == {"p50": None, "p90": None, "p99": None}
    assert empty["streamed_migrations"] == 0 and empty["overlap_pct"]["p50"] is None
    assert empty["prefix_hit_share"] is None
    json.dumps(empty, allow_nan=False)


# ---- end to end against an in-process server -------------------------------------------------
@pytest.fixture(scope="module")
def server_url():
    import torch

    from coordinator.http import HTTPConfig, make_app, start_server
    from deploy.in_process import LocalEngineBackend
    from engine.engine import EngineConfig

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    backend = LocalEngineBackend(EngineConfig(model="tiny", num_blocks=512)).start()
    app = make_app(backend, HTTPConfig(stall_timeout_s=60))
    runner, port = asyncio.run_coroutine_threadsafe(start_server(app, "127.0.0.1", 0), loop).result(30)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        backend.close()
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
        loop.close()
        torch.set_num_threads(threads)


def test_a_refused_request_is_recorded_as_failed(server_url):
    specs = [RequestSpec(0, 0.0, [65] * 2040, 20), RequestSpec(1, 0.0, [66] * 8, 3)]
    recs, dur = asyncio.run(run_load(server_url, specs, timeout_s=60))
    assert not recs[0].ok and recs[0].error.startswith("HTTP 400") and recs[0].first_s is None
    assert recs[1].ok and recs[1].output_tokens == 3 and recs[1].chunk_tokens and dur > 0


def test_bench_serve_cli_against_a_running_server(server_url, tmp_path):
    from pdserve_cli.main import main

    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    code = main(["bench", "serve", "--quick", "--model", "tiny", "--url", server_url, "--mode", "colocated",
                 "--rates", "8,16", "--num-requests", "6", "--preset", "short-prompt-long-output",
                 "--tpot-slo-ms", "1000", "--ttft-slo-scale", "7", "--detailed", "--json", str(out),
                 "--plot", str(png)])
    assert code == 0
    rep = json.loads(out.read_text())
    scaling = rep["slo_scaling"]  # TTFT: 7 x the unloaded TTFT p50 measured at the start; TPOT fixed
    assert scaling["ttft_multiple"] == 7.0 and scaling["tpot_multiple"] is None
    assert rep["slo"] == {"ttft_ms": pytest.approx(7 * scaling["unloaded_ttft_ms"]), "tpot_ms": 1000.0}
    assert scaling["unloaded_ttft_ms"] == rep["overhead"]["colocated"]["prefill_only"]["ttft_ms"]["p50"]
    assert scaling["unloaded_tpot_ms"] == rep["overhead"]["colocated"]["full"]["tpot_ms"]["p50"] > 0
    g = rep["goodput"]["colocated"]  # fixed rates: the goodput of the rates given
    assert [s["rate"] for s in g["steps"]] == [8.0, 16.0] and g["ci_method"]
    att = {r["rate"]: sum(r["slo_met"]) / len(r["slo_met"]) for r in rep["runs"]}
    assert g["goodput_req_s"] == max([0.0] + [r for r in att if all(att[q] >= 0.9 for q in att if q <= r)])
    assert [(r["mode"], r["rate"]) for r in rep["runs"]] == [("colocated", 8.0), ("colocated", 16.0)]
    specs = make_requests(preset("short-prompt-long-output", 8.0, 6, seed=bs.QUICK.seed + 1))
    for r in rep["runs"]:
        assert RUN_KEYS <= set(r) and VLLM_KEYS <= set(r)
        assert (r["completed"], r["failed"]) == (6, 0)
        assert all(set(r[k]) == {"p50", "p90", "p99"} for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"))
        assert r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"] <= r["e2e_ms"]["p99"]
        assert r["migration_share_of_ttft"]["p99"] == 0.0  # one in-process engine: nothing migrates
        assert r["streamed"] is False and r["label"] == "colocated" and r["streamed_migrations"] == 0
        assert r["client_pid"] != os.getpid()  # the load client ran in a process of its own
    assert rep["runs"][0]["total_output_tokens"] == sum(s.max_tokens for s in specs)
    reqs = rep["runs"][0]["requests"]  # --detailed: the client records, in spec order
    want = [s.max_tokens for s in specs]
    assert [q["max_tokens"] for q in reqs] == [q["output_tokens"] for q in reqs] == want
    assert all(q["ok"] and 0 <= q["send_s"] < q["first_s"] <= q["end_s"] for q in reqs)
    assert all(0 <= q["cached_tokens"] < q["prompt_tokens"] for q in reqs)  # the server said, per request
    assert 0 <= rep["runs"][0]["prefix_hit_share"] < 1
    o = rep["overhead"]["colocated"]
    assert o["prefill_only"]["completed"] == o["full"]["completed"] == bs.QUICK.overhead_requests
    assert png.stat().st_size > 10_000
    assert rep["config"]["quick"] and "p99" in rep["config"]["p99_note"]  # 6 requests: p99 is about the max
    assert rep["config"]["client"] == "subprocess" and rep["config"]["bench_pid"] == os.getpid()


def test_streamed_and_whole_disaggregated_runs_are_labelled_in_one_invocation(server_url, monkeypatch):
    """The plan without Ray: the in-process server stands in for each cluster, which records the
    ClusterConfig it was given (stream_migration on, then off, then the colocated one; the same
    step budget in all three)."""
    import deploy.launch as dl
    from measure.serve_report import format_goodput, format_overhead, format_table

    port = int(server_url.rsplit(":", 1)[1])
    configs = []

    class FakeServer:
        def __init__(self, config):
            configs.append(config)

        def start(self, timeout=None):
            return port

        def stop(self):
            pass

    monkeypatch.setattr(dl, "ClusterServer", FakeServer)
    monkeypatch.setattr(dl, "start_ray", lambda config: False)
    monkeypatch.setattr(dl, "stop_ray", lambda started: None)
    cfg = bs.ServeBenchConfig(rates=(20.0,), num_requests=3, preset="short-prompt-long-output", model="tiny",
                              overhead_requests=1, warmup_requests=0, step_budget=256,
                              modes=("disaggregated", "colocated", "per_request"), colocated_budgets=())
    assert cfg.streamed == (True, False) and bs.ServeBenchConfig().num_requests >= 200
    logs = []
    rep = bs.run_bench(cfg, log=logs.append)
    want = [(False, True, "always"), (False, False, "always"), (True, False, "always"), (False, True, "auto")]
    assert [(c.colocated > 0, c.stream_migration, c.disaggregate) for c in configs] == want
    assert all(c.engine == {"scheduler": {"max_num_batched_tokens": 256}} for c in configs)
    # every worker on one thread and a core of its own; 2 workers on this machine's cores
    assert all(c.torch_threads == 1 and c.pin_cpus == tuple(sorted(os.sched_getaffinity(0))) for c in configs)
    assert rep["placement"]["colocated"]["workers"] == 2 and "workers_info" in rep["placement"]["colocated"]
    runs = rep["runs"]
    assert [(r["mode"], r["streamed"], r["label"]) for r in runs] == [
        ("disaggregated", True, "disaggregated"), ("disaggregated", False, "disaggregated-whole"),
        ("colocated", False, "colocated"), ("per_request", True, "per-request")]
    assert all(r["completed"] == 3 and r["client_pid"] != os.getpid() for r in runs)
    assert len({r["client_pid"] for r in runs}) == 4  # a fresh client process per run
    assert set(rep["overhead"]) == {"disaggregated", "disaggregated-whole", "colocated", "per-request"}
    assert rep["slo_scaling"]["measured_on"] == "disaggregated"  # the first setup calibrates every one
    assert rep["overhead"]["disaggregated"]["streamed"] and not rep["overhead"]["colocated"]["streamed"]
    assert rep["config"]["streamed"] == [True, False] and rep["config"]["step_budget"] == 256
    # the stand-in migrates nothing: the bench says so rather than reporting a streamed run silently
    assert any("no migration streamed" in line for line in logs)
    table = format_table(rep)
    assert table.count("| disaggregated | yes |") == 1 and table.count("| disaggregated | no |") == 1
    good = format_goodput(rep).splitlines()
    assert "disaggregated, streamed" in good[0] and "disaggregated, whole" in good[0] and len(good) == 3
    assert "disaggregated, whole" in format_overhead(rep)
    json.dumps(rep, allow_nan=False)


def test_quick_says_p99_is_about_the_max_and_the_full_run_does_not():
    assert bs.p99_note(bs.QUICK.num_requests) and "≈ max" in bs.p99_note(40)
    assert bs.p99_note(200) is None and bs.p99_note(101) is None and bs.p99_note(100)
    a = np.arange(100.0)
    assert np.percentile(a, 99) > a[-2] and np.percentile(np.arange(200.0), 99) < 198  # why 101
    with pytest.raises(ValueError):
        bs.ServeBenchConfig(streamed=())
    ray = bs.ServeBenchConfig(transport="ray")  # every transport streams, Ray too
    assert [(s.mode, s.streamed, s.step_budget, s.label) for s in bs.setups(ray)] == [
        ("colocated", False, 128, "colocated-128"), ("colocated", False, 256, "colocated-256"),
        ("colocated", False, 512, "colocated-512"),
        *[("disaggregated", s, 512, bs.label("disaggregated", s)) for s in ray.streamed],
        ("per_request", True, 512, "per-request")]


def test_the_goodput_search_runs_on_the_server_and_a_trace_replays(server_url, tmp_path):
    """--model tiny against the in-process server: the goodput search (no --rates) with scaled SLOs,
    then the shipped Mooncake trace at a fixed time scale."""
    from pdserve_cli.main import main

    out = tmp_path / "search.json"
    code = main(["bench", "serve", "--model", "tiny", "--url", server_url, "--mode", "colocated",
                 "--preset", "short-prompt-long-output", "--num-requests", "5", "--search-steps", "2",
                 "--search-start", "4", "--json", str(out)])
    rep = json.loads(out.read_text())
    assert code == 0 and rep["config"]["model"] == "tiny" and rep["config"]["search"]["steps"] == 2
    g = rep["goodput"]["colocated"]
    assert [s["rate"] for s in g["steps"]] == [r["rate"] for r in rep["runs"]] and len(g["steps"]) == 2
    assert g["steps"][0]["rate"] == 4.0 and [r["search_step"] for r in rep["runs"]] == [0, 1]
    assert [r["seed"] for r in rep["runs"]] == [1, 2]  # each step its own prompts
    assert rep["slo_scaling"]["ttft_multiple"] == 5.0 and rep["slo_scaling"]["tpot_multiple"] == 2.0
    trace = tmp_path / "trace.json"
    code = main(["bench", "serve", "--model", "tiny", "--url", server_url, "--mode", "colocated",
                 "--trace", "measure/traces/small.jsonl", "--time-scale", "0.05", "--num-requests", "4",
                 "--ttft-slo-ms", "60000", "--tpot-slo-ms", "60000", "--json", str(trace)])
    rep = json.loads(trace.read_text())
    from measure.serve_trace import read_mooncake

    recs = read_mooncake("measure/traces/small.jsonl")[:4]
    (run,) = rep["runs"]
    assert code == 0 and run["completed"] == 4 and run["time_scale"] == pytest.approx(0.05)
    assert run["total_input_tokens"] == sum(r.input_length for r in recs)
    assert run["total_output_tokens"] == sum(r.output_length for r in recs)
    assert rep["config"]["trace"] == "measure/traces/small.jsonl"
    assert rep["slo_scaling"]["ttft_multiple"] is None


def test_best_colocated_budget_is_the_baseline_and_overlapping_intervals_tie():
    g = {"colocated-128": {"goodput_req_s": 1.0, "ci": [0.5, 1.5]},
         "colocated-512": {"goodput_req_s": 2.0, "ci": [1.8, 2.4]},
         "disaggregated": {"goodput_req_s": 3.0, "ci": [2.5, None]},
         "per-request": {"goodput_req_s": 2.2, "ci": [2.0, 2.6]}}
    c = bs.compare(g)
    assert c["best_colocated"] == {"label": "colocated-512", "goodput_req_s": 2.0, "ci": [1.8, 2.4]}
    assert c["against_best_colocated"] == {"disaggregated": {"ratio": 1.5, "tie": False},
                                          "per-request": {"ratio": 1.1, "tie": True}}


def test_placement_says_when_workers_share_a_core():
    one_each = bs.placement(2, [0, 1, 2, 3], True)
    assert one_each["worker_cpus"] == [0, 1] and one_each["cores_left_for_coordinator_and_client"] == 2
    assert not one_each["shared_core"] and one_each["workers_per_core"] == 1
    three = bs.placement(3, [0, 1], True)  # 2:1 on two cores: two workers on one core, reported so
    assert three["worker_cpus"] == [0, 1, 0] and three["shared_core"] and three["workers_per_core"] == 2
    assert three["cores_left_for_coordinator_and_client"] == 0
    assert bs.placement(2, [0, 1], False) == {"pinned": False, "cpus": [0, 1], "workers": 2}


def test_cluster_config_serves_the_model_asked_for(tmp_path):
    tiny = bs.cluster_config("colocated", bs.ServeBenchConfig(model="tiny"), step_budget=128)
    assert tiny.model == "tiny" and tiny.engine == {"scheduler": {"max_num_batched_tokens": 128}}
    real = bs.cluster_config("disaggregated", bs.ServeBenchConfig())  # SmolLM2 by default, gguf weights
    assert real.model == "smollm2" and real.engine["weights"] == "gguf" and real.prefill == real.decode == 1
    assert bs.cluster_config("colocated", bs.ServeBenchConfig(pin_workers=False)).pin_cpus == ()
    # the step pacer off: a step is the chunk budget compared; None keeps the cluster's own pacer
    from coordinator.config import ClusterConfig

    assert tiny.step_target_s == 0.0
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"fits": {"local_prefill_max_tokens": 140, "prefill_ms_per_token": 0.3}}))
    auto = bs.cluster_config("per_request", bs.ServeBenchConfig(model="tiny", decide_profile=str(prof)))
    assert (auto.disaggregate, auto.local_prefill_max_tokens, auto.prefill_ms_per_token) == ("auto", 140, 0.3)
    plain = bs.cluster_config("per_request", bs.ServeBenchConfig(model="tiny"))
    assert plain.prefill_ms_per_token == ClusterConfig().prefill_ms_per_token  # the startup timing decides
    kept = bs.cluster_config("colocated", bs.ServeBenchConfig(model="tiny", step_target_s=None))
    assert kept.step_target_s == ClusterConfig().step_target_s > 0
