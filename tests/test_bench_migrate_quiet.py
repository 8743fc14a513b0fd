"""`pdserve bench migrate` over NIXL prints its own progress only: NIXL's INFO lines (one per agent
and backend made) are kept out (measure.migrate.quiet_nixl). One tiny point, in a subprocess (NIXL
reads NIXL_LOG_LEVEL when first imported)."""

import os
import subprocess
import sys

import pytest

from transfer.channels.nixl_pool import available

pytestmark = pytest.mark.skipif(not available(), reason="nixl is not installed")
ARGS = ["bench", "migrate", "--kv-shape", "tiny", "--tokens", "16", "--transports", "nixl", "--repeats", "2",
        "--no-baselines"]


def _run(**env) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "NIXL_LOG_LEVEL"}
    run = subprocess.run([sys.executable, "-m", "pdserve_cli.main", *ARGS], capture_output=True, text=True,
                         timeout=240, env={**clean, "OMP_NUM_THREADS": "1", **env})
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout + run.stderr


def test_nixl_info_lines_stay_out_of_the_progress():
    out = _run()
    assert "nixl     tiny T=16 B=16" in out and "verified=True" in out, out
    assert "NIXL INFO" not in out, out

