"""`pdserve bench report`: docs/results.md is exactly what the JSON under docs/results gives, and a
run filed under the wrong machine is refused rather than reported under another machine's name."""

import json
import shutil
from pathlib import Path

import pytest

from bench.report import ResultsError, load, machine_name, render, summarize
from pdserve_cli.main import main

ROOT = Path(__file__).resolve().parent.parent
CPU = {"machine": {"cpu": {"vendor": "AuthenticAMD", "model": "AMD EPYC", "family": "25",
                           "model_number": "1"}}}


def test_committed_results_md_is_what_the_json_gives():
    assert (ROOT / "docs/results.md").read_text() == render(ROOT / "docs/results")


def test_every_results_folder_is_one_recorded_machine():
    machines = load(ROOT / "docs/results")
    assert machines, "no results kept"
    for name, runs in machines.items():
        recorded = {machine_name(r) for r in runs.values()} - {None}
        assert recorded <= {name}


def test_machine_names():
    assert machine_name(CPU) == "amd-epyc-f25m1"
    intel = {"machine": {"cpu": {"vendor": "GenuineIntel", "model": "Intel(R) Xeon(R) Processor",
                                 "family": "6", "model_number": "167"}}}
    assert machine_name(intel) == "intel-xeon-f6m167"
    assert machine_name({"device": "NVIDIA H200", "results": []}) == "nvidia-h200"
    assert machine_name({"cases": 3}) is None


def test_a_run_in_another_machines_folder_is_refused(tmp_path):
    (tmp_path / "intel-xeon-f6m167").mkdir()
    (tmp_path / "intel-xeon-f6m167" / "engine-tiny-short.json").write_text(json.dumps(CPU))
    with pytest.raises(ResultsError, match="amd-epyc-f25m1"):
        render(tmp_path)


def test_cli_writes_then_checks(tmp_path, capsys):
    results = tmp_path / "results"
    shutil.copytree(ROOT / "docs/results/amd-epyc-f25m1", results / "amd-epyc-f25m1")
    out = tmp_path / "results.md"
    args = ["bench", "report", "--results", str(results), "--out", str(out)]
    assert main(args + ["--check"]) == 1  # nothing written yet
    assert main(args) == 0
    assert "| wrong answers, leaked blocks | 0, 0 | 0, 0 | pass |" in out.read_text()
    assert main(args + ["--check"]) == 0
    out.write_text(out.read_text() + "edited by hand\n")
    assert main(args + ["--check"]) == 1


def _goodput(g: float, lo: float, hi: float | None) -> dict:
    return {"goodput_req_s": g, "ci": [lo, hi], "bracket": [g, hi]}


def _serve(preset: str, colo: dict, disagg: dict, auto: dict) -> dict:
    full = {"migration_ms": {"p50": 4.0}, "ttft_ms": {"p50": 2000.0}}
    return {**CPU, "config": {"preset": preset, "trace": None}, "slo": {"ttft_ms": 8000.0, "tpot_ms": 30.0},
            "goodput": {"colocated-128": colo, "colocated-512": _goodput(0.1, 0.05, 0.2),
                        "disaggregated": disagg, "per-request": auto},
            "overhead": {"disaggregated": {"full": full}}}


def _plan(colo: float, disagg: float, auto: float, best: str) -> dict:
    return {"budgets": {"2": {"best": best, "configs": [
        {"config": "colocated 2", "sustained_rate": colo}, {"config": "1P+1D", "sustained_rate": disagg},
        {"config": "1P+1D auto", "sustained_rate": auto}]}}}


def test_the_serving_study_pairs_each_workload_with_its_plan(tmp_path):
    folder = tmp_path / "results" / "amd-epyc-f25m1"
    shutil.copytree(ROOT / "docs/results/amd-epyc-f25m1", folder)  # the headline's runs
    # separated: 1P+1D 0.4 [0.3-0.6] against colocated 0.2 [0.1-0.25]; auto ties 1P+1D
    (folder / "serve-long-prompt-long-output.json").write_text(json.dumps(_serve(
        "long-prompt-long-output", _goodput(0.2, 0.1, 0.25), _goodput(0.4, 0.3, 0.6),
        _goodput(0.35, 0.3, None))))
    (folder / "plan-long-prompt-long-output.json").write_text(json.dumps(_plan(0.2, 0.4, 0.4, "1P+1D")))
    (folder / "serve-mixed.json").write_text(json.dumps(_serve(
        "mixed", _goodput(1.0, 0.8, 1.5), _goodput(0.5, 0.4, 0.7), _goodput(0.9, 0.8, 1.2))))
    record = json.loads((folder / "serve-long-prompt-long-output.json").read_text())
    record["runs"] = [{"label": "disaggregated", "rate": 0.6, "ttft_ms": {"p50": 2500.0, "p99": 9000.0},
                       "tpot_ms": {"p50": 24.0, "p99": 41.0}}]  # where the best (1P+1D) saturates
    (folder / "serve-long-prompt-long-output.json").write_text(json.dumps(record))
    out = tmp_path / "results.md"
    args = ["bench", "report", "--results", str(tmp_path / "results"), "--out", str(out)]
    assert main(args) == 0
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith(("| long-prompt", "| mixed"))]
    assert len(rows) == 4, text  # the goodput table's two rows, then the latency table's
    llo, mixed, llo_at, _ = rows
    assert llo_at == "| long-prompt-long-output | disaggregated | 0.6 | - | 2.50/9.00 s, 24/41 ms | - |"
    record["runs"].append({"label": "colocated-128", "rate": 0.3, "ttft_ms": {"p50": 900.0, "p99": 3000.0},
                           "tpot_ms": {"p50": 30.0, "p99": 90.0}})
    (folder / "serve-long-prompt-long-output.json").write_text(json.dumps(record))
    assert main(args) == 0
    assert "| 0.6 | 0.90/3.00 s, 30/90 ms (at 0.3) | 2.50/9.00 s, 24/41 ms | - |" in out.read_text()
    # the best colocated budget is the baseline; 1P+1D separated from it, per-request tied with 1P+1D
    assert "0.20 [0.10–0.25] (colocated-128)" in llo and "| 2.00x |" in llo and "| 0.87x (tie) |" in llo
    assert "| 0.2% |" in llo
    assert "| 0.20 / 0.40 / 0.40 | disaggregated | disaggregated (tie: per-request) |" in llo
    assert "| 0.50x |" in mixed and "| - | - | colocated (tie: per-request) |" in mixed  # no plan
    assert (folder / "serve-goodput.png").stat().st_size > 0 and "serve-goodput.png" in text
    assert "serve-mixed.json" in text and "serve-mixed` " not in text  # in the study, not listed again
    assert main(args + ["--check"]) == 0


def test_bench_sim_reports_are_summarized():
    seeds = {"seeds": 1000, "failures": [], "transport": "zmq", "jobs": 2, "seeds_per_s": 400.0,
             "seconds": 2.5}
    rows = summarize("sim-1m", seeds)
    assert rows[0] == ("1,000 seeds under zmq's guarantees: broken invariants", "0", "0", "pass")
    assert rows[1][0].startswith("seeds per second (2 processes)") and rows[1][1] == "400"
    broken = summarize("sim-1m", {**seeds, "failures": [{"seed": 3}]})
    assert broken[0][1:] == ("1", "0", "FAIL")
    explored = {"runs": 954, "states": 752, "seconds": 2.4, "complete": True, "violation": None,
                "requests": 1, "max_faults": 2, "max_messages": 40, "transport": "zmq"}
    (row,) = summarize("sim-exhaustive", explored)
    assert "1 request, <= 2 faults in the first 40 sends, zmq" in row[0] and row[3] == "pass"
    assert summarize("sim-exhaustive", {**explored, "complete": False})[0][3] == "FAIL"
