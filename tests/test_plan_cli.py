"""`pdserve plan` end to end on a hand-written profile and a small trace (no cluster): the table,
the verdict line, the JSON and the plot."""

from __future__ import annotations

import json

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
    assert rc == 2 and "not a trace" in capsys.readouterr().out
