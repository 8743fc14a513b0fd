"""`pdserve bench report`: docs/results.md is exactly what the JSON under docs/results gives, and a
run filed under the wrong machine is refused rather than reported under another machine's name."""

import json
import shutil
from pathlib import Path

import pytest

from bench.report import ResultsError, load, machine_name, render
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
