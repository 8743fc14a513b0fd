"""The migration benchmark end to end at a tiny size, through the `pdserve bench migrate`
command: a real receiving process, verified transfers, the documented JSON shape and a plot;
plus the baselines that are cheap to run here."""

import json

from bench import baselines
from bench.migrate_report import summarize
from pdserve_cli.main import main

RESULT_KEYS = {"transport", "kv_shape", "tokens", "block_size", "bytes", "latency_ms_p50", "latency_ms_p99",
               "gb_per_s", "verified", "export_ms_p50", "wire_ms_p50", "import_ms_p50", "manifest_ratio"}


def test_bench_migrate_cli_writes_verified_json_and_plot(tmp_path):
    out, png = tmp_path / "m.json", tmp_path / "m.png"
    rc = main(["bench", "migrate", "--kv-shape", "tiny", "--kv-shape", "2,1,8,float32", "--tokens", "16,40",
               "--block-sizes", "16", "--transports", "zmq-tcp,zmq-ipc", "--repeats", "2", "--no-baselines",
               "--json", str(out), "--plot", str(png)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert set(report) == {"results", "baselines"} and report["baselines"] == []
    rows = report["results"]
    assert len(rows) == 2 * 2 * 2
    assert all(RESULT_KEYS <= set(r) and r["verified"] for r in rows)
    assert {(r["transport"], r["kv_shape"], r["tokens"]) for r in rows} == {
        (t, s, n) for t in ("zmq-tcp", "zmq-ipc") for s in ("tiny", "2,1,8,float32") for n in (16, 40)}
    tiny40 = next(r for r in rows if r["kv_shape"] == "tiny" and r["tokens"] == 40)
    assert tiny40["bytes"] == 3 * 16 * 256 and tiny40["frames"] == 1  # 3 blocks of 16 tokens, 256 B each
    assert summarize(report)["all_verified"]
    assert png.stat().st_size > 10_000


def test_cheap_baselines_measure_something():
    assert baselines.memcpy(1 << 20, 2) > 0
    nixl = baselines.nixl(1 << 16, 1)
    assert nixl["gb_per_s"] is not None or nixl["note"]
