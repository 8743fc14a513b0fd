"""A tiny `pdserve bench soak` (12 s at 2 req/s on a local Ray): requests are answered, the cluster
comes to rest with no block leaked, the JSON has a sample per period with every worker's RSS and
free blocks plus their slopes, and the plot is written. No thresholds on the slopes themselves."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ray")

from pdserve_cli.main import main  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_tiny_soak(ray_local, tmp_path):
    out, fig = tmp_path / "soak.json", tmp_path / "soak.png"
    rc = main(["bench", "soak", "--minutes", "0.2", "--sample-s", "1", "--json", str(out),
               "--plot", str(fig)])
    report = json.loads(out.read_text())
    assert fig.stat().st_size > 0
    assert report["requests"]["sent"] > 5 and report["requests"].get("failed", 0) == 0
    assert report["at_rest"]["leaked_blocks"] == 0
    samples = report["samples"]
    assert len(samples) >= 8
    names = set(samples[-1]["workers"])
    assert {"prefill-0", "decode-0", "decode-1"} <= names
    for w in samples[-1]["workers"].values():
        assert w["rss_mib"] > 0 and w["free_blocks"] + w["cached_blocks"] + w["used_blocks"] > 0
    for name in names:
        assert report["slopes"][name]["rss_mib_per_min"] is not None
        assert report["slopes"][name]["available_blocks_per_min"] is not None
    assert rc == 0
