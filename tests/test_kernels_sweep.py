"""`python -m bench.kernels_sweep` without CUDA: one tiny decode and prefill case each under the
Triton interpreter, every variant checked against the default launch (its times mean nothing)."""

import json

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the sweep is a benchmark run, not a test")
def test_sweep_smoke_writes_checked_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from bench.kernels_sweep import main

    assert main(["--json", str(tmp_path / "s.json")]) == 0
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert {r["kernel"] for r in rows} == {"decode", "prefill"}
    assert all(r["max_abs_diff"] < 1e-5 and r["ms"] > 0 for r in rows)
    assert any(r["default"] for r in rows if r["kernel"] == "decode")
