"""`pdserve plan` end to end on a hand-written profile and a small trace (no cluster): the table,
the verdict line, the JSON and the plot."""

from __future__ import annotations

import json
import statistics

import pytest

from coordinator.config import ClusterConfig
from pdserve_cli.main import main

FITS = {"prefill_fixed_ms": 1.0, "prefill_ms_per_token": 0.01, "decode_step_fixed_ms": 0.6,
        "decode_ms_per_sequence": 0.07, "decode_ms_per_context_token": 0.0, "migration_fixed_ms": 1.0,
        "migration_ms_per_byte": 1e-6, "kv_bytes_per_token": 2048.0, "local_prefill_max_tokens": 75}


def test_plan_cli_trace_json_and_plot(tmp_path, capsys):
    prof, trace = tmp_path / "profile.json", tmp_path / "trace.json"
    prof.write_text(json.dumps({"fits": FITS, "decode": [], "config": {"block_size": 16}}))
    reqs = [{"arrival_s": i * 0.2, "prompt_tokens": 40 + 10 * (i % 5), "output_tokens": 8,
             "prefix_id": "sys" if i % 2 else None, "prefix_tokens": 32 if i % 2 else 0} for i in range(20)]
    trace.write_text(json.dumps({"requests": reqs}))
    out_json, out_png = tmp_path / "plan.json", tmp_path / "plan.png"
    rc = main(["plan", "--profile", str(prof), "--trace", str(trace), "--rates", "2,4", "--budget", "2,3",
               "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "disaggregation pays:" in text and "per-request threshold" in text and "2P+1D auto" in text
    plan = json.loads(out_json.read_text())
    assert set(plan["budgets"]) == {"2", "3"}
    default = ClusterConfig.__dataclass_fields__["local_prefill_max_tokens"].default
    assert plan["threshold"] == {"local_prefill_max_tokens": default, "profile_crossover": 75}
    assert all(p["requests"] == 20 for c in plan["budgets"]["2"]["configs"] for p in c["points"])
    assert out_png.stat().st_size > 0


def test_validate_refuses_a_workload_bench_serve_cannot_replay(tmp_path, capsys):
    # --validate serves a bench serve preset: with a trace it would have measured another workload
    prof, trace = tmp_path / "profile.json", tmp_path / "trace.json"
    prof.write_text(json.dumps({"fits": FITS, "decode": [], "config": {"block_size": 16}}))
    trace.write_text(json.dumps({"requests": [{"arrival_s": 0.0, "prompt_tokens": 40, "output_tokens": 8}]}))
    rc = main(["plan", "--profile", str(prof), "--trace", str(trace), "--validate"])
    assert rc == 2 and "not a plan trace JSON" in capsys.readouterr().out


def test_plan_without_a_profile_finds_one_or_names_the_command(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--rates", "2"]) == 2
    out = capsys.readouterr().out
    assert "pdserve profile --model smollm2 --json profile-smollm2.json" in out
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "profile-tiny.json").write_text(
        json.dumps({"fits": FITS, "decode": [], "config": {"block_size": 16, "model": "tiny"}}))
    assert main(["plan", "--model", "tiny", "--rates", "2", "--num-requests", "20"]) == 0
    assert "profile: out/profile-tiny.json (model tiny)" in capsys.readouterr().out


def test_plan_reads_a_mooncake_trace_and_scales_its_slos(tmp_path, capsys):
    from planner.model import from_profile
    from planner.workload import load_trace

    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"fits": FITS, "decode": [], "config": {"block_size": 16}}))
    out_json, out_png = tmp_path / "plan.json", tmp_path / "plan.png"
    rc = main(["plan", "--profile", str(prof), "--trace", "measure/traces/small.jsonl", "--rates", "2,4",
               "--tpot-slo-scale", "3", "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    plan = json.loads(out_json.read_text())
    assert all(p["requests"] == 120 for c in plan["budgets"]["2"]["configs"] for p in c["points"])
    scaling, slo = plan["inputs"]["slo_scaling"], plan["inputs"]["slo"]
    assert scaling["ttft_multiple"] == 5.0 and scaling["tpot_multiple"] == 3.0
    assert slo["ttft_ms"] == 5.0 * scaling["unloaded_ttft_ms"]
    assert slo["tpot_ms"] == 3.0 * scaling["unloaded_tpot_ms"]
    model = from_profile(json.loads(prof.read_text()))
    reqs = load_trace("measure/traces/small.jsonl")
    path = model.colocated
    unloaded = [model.prefill_ms(r.prompt_tokens) + path.ttft_ms(r.prompt_tokens, r.prompt_tokens, 0.0)
                for r in reqs]
    assert scaling["unloaded_ttft_ms"] == pytest.approx(statistics.median(unloaded))
    shared = [r for r in reqs if r.prefix_id]
    assert len(shared) == len(reqs) and all(r.prefix_tokens % 512 == 0 or r.prefix_tokens == r.prompt_tokens
                                            for r in shared)


def test_mooncake_prefixes_are_the_longest_leading_ids_shared():
    from measure.serve_trace import TraceRecord
    from planner.workload import from_mooncake

    recs = [TraceRecord(0.0, 1100, 4, (7, 8, 9)), TraceRecord(500.0, 700, 4, (7, 8)),
            TraceRecord(1000.0, 600, 4, (7, 5)), TraceRecord(2000.0, 100, 4, (1,))]
    reqs = from_mooncake(recs)
    assert [(r.prefix_id, r.prefix_tokens) for r in reqs] == [("h7-8", 1024), ("h7-8", 700), ("h7", 512),
                                                              (None, 0)]
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 1.0, 2.0]


def test_the_plot_gives_every_configuration_its_own_marker_and_line_style():
    from planner.report import figure

    points = [{"rate": 1.0, "goodput_req_s": 1.0}, {"rate": 2.0, "goodput_req_s": 2.0}]
    rows = [{"config": f"c{i}", "points": points} for i in range(5)]  # five configurations on one line
    fig = figure({2: {"rows": rows, "best": "c0"}})
    lines = [ln for ln in fig.axes[0].get_lines() if ln.get_label().startswith("c")]
    assert len(lines) == 5
    looks = {(ln.get_marker(), ln.get_linestyle(), ln.get_markersize()) for ln in lines}
    assert len(looks) == 5 and all(ln.get_fillstyle() == "none" for ln in lines)


def test_profile_and_validation_serve_the_model_asked_for():
    from measure.serve import setups
    from measure.serve_metrics import SLO
    from pdserve_cli.cmd_up import DEFAULTS
    from planner.profile import ProfileConfig
    from planner.validate import _serve_config

    assert ProfileConfig().model == DEFAULTS["model"] == "smollm2"  # profile defaults to up's model
    cfg = _serve_config([1.0], 10, SLO(ttft_ms=900.0, tpot_ms=40.0), model="smollm2", step_budget=256)
    assert cfg.model == "smollm2" and cfg.slo_scale.fixed and cfg.slo == SLO(900.0, 40.0)
    assert [(s.mode, s.step_budget, s.label) for s in setups(cfg)] == [
        ("colocated", 256, "colocated"), ("disaggregated", 256, "disaggregated"),
        ("per_request", 256, "per-request")]
    assert _serve_config([1.0], 10, SLO()).model == "tiny"  # saved validations from before: tiny


def test_validation_by_goodput_search_sets_prediction_beside_measurement():
    from planner.validate import SERVE_LABELS, goodput_against

    measured = {"colocated": {"goodput_req_s": 0.2, "ci": [0.1, 0.3]},
                "disaggregated": {"goodput_req_s": 0.5, "ci": [0.4, None]},
                "per-request": {"goodput_req_s": 0.45, "ci": [0.35, 0.8]}}
    predicted = {"colocated 2": 0.3, "1P+1D": 0.5, "1P+1D auto": 0.6}
    g = goodput_against(measured, predicted)
    assert set(g["configs"]) == set(SERVE_LABELS.values())
    c = g["configs"]["colocated 2"]
    assert c["error"] == pytest.approx(0.5) and not c["within_target"]
    assert g["configs"]["1P+1D"]["within_target"] and g["measured_best"] == "1P+1D"
    # the plan picks auto, which the measurement cannot tell from 1P+1D: a match; colocated is separated
    assert g["measured_tied_with_best"] == ["1P+1D", "1P+1D auto"]
    assert g["predicted_best"] == "1P+1D auto" and g["pick_matches"] is True
    assert goodput_against(measured, {"colocated 2": 1.0})["pick_matches"] is False
