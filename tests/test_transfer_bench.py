"""The migration benchmark end to end at a tiny size, through the `pdserve bench migrate`
command: a real receiving process and a Ray actor, verified transfers, the documented JSON shape,
the baselines it measures beside them (a two-process raw TCP socket and Ray put/get must really
move the bytes), the fixed-overhead fit per transport, the plot and the Chrome trace."""

import json
import math

import pytest

from bench import baselines
from bench.migrate_report import fit_overhead, format_summary, summarize
from pdserve_cli.main import main

pytestmark = pytest.mark.own_ray  # bench migrate starts Ray in this process (conftest)

RESULT_KEYS = {"transport", "kv_shape", "tokens", "block_size", "bytes", "latency_ms_p50", "latency_ms_p99",
               "gb_per_s", "verified", "export_ms_p50", "wire_ms_p50", "import_ms_p50", "manifest_ratio"}
TRANSPORTS = ("zmq-tcp", "zmq-ipc", "ray")
SHAPES = ("tiny", "2,1,8,float32")


def test_bench_migrate_cli_writes_verified_json_plot_and_trace(tmp_path):
    pytest.importorskip("ray")
    out, png, trace = tmp_path / "m.json", tmp_path / "m.png", tmp_path / "t.json"
    rc = main(["bench", "migrate", "--kv-shape", SHAPES[0], "--kv-shape", SHAPES[1], "--tokens", "16,40",
               "--block-sizes", "16", "--transports", ",".join(TRANSPORTS), "--repeats", "2",
               "--json", str(out), "--plot", str(png), "--trace", str(trace)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert {"results", "baselines", "timeline"} <= set(report)
    rows = report["results"]
    assert len(rows) == 3 * 2 * 2
    assert all(RESULT_KEYS <= set(r) and r["verified"] is True for r in rows)
    assert {(r["transport"], r["kv_shape"], r["tokens"]) for r in rows} == {
        (t, s, n) for t in TRANSPORTS for s in SHAPES for n in (16, 40)}
    tiny40 = next(r for r in rows if r["kv_shape"] == "tiny" and r["tokens"] == 40)
    assert tiny40["bytes"] == 3 * 16 * 256 and tiny40["frames"] == 1  # 3 blocks of 16 tokens, 256 B each

    # Baselines at every payload size: the socket and Ray baselines moved (and verified) the bytes.
    sizes = {r["bytes"] for r in rows}
    for name in ("raw_tcp", "ray_put_get", "memcpy"):
        got = {b["bytes"]: b for b in report["baselines"] if b["name"] == name}
        assert set(got) == sizes, name
        assert all(b["gb_per_s"] is not None and b["gb_per_s"] > 0 for b in got.values()), name
        if name != "memcpy":
            assert all(b["verified"] is True for b in got.values()), name
    for name in ("nixl", "nixl_xxh3"):  # the bare WRITE, and the same doing pdserve's integrity work
        nixl = [b for b in report["baselines"] if b["name"] == name]
        assert nixl and all((b["gb_per_s"] or 0) > 0 or b["note"] == "nixl not installed" for b in nixl), name

    s = summarize(report)
    assert s["all_verified"]
    assert set(s["fixed_overhead_ms"]) == set(TRANSPORTS)
    for fit in s["fixed_overhead_ms"].values():
        assert fit["points"] == 4
        assert math.isfinite(fit["intercept_ms"]) and math.isfinite(fit["slope_ms_per_mib"])
    for e in s["largest"]:
        assert e["vs_raw_tcp"] > 0 and e["vs_ray_put_get"] > 0 and e["vs_memcpy"] > 0
    text = format_summary(s)
    assert "x raw_tcp" in text and "x ray_put_get" in text and "intercept" in text

    # The timeline: every timed migration, and the trace built from it.
    assert len(report["timeline"]) == len(rows) * 2
    assert all(m["verified"] and m["export_ms"] >= 0 and m["wire_ms"] > 0 for m in report["timeline"])
    zmq_timings = [m["receiver_ms"] for m in report["timeline"] if m["transport"] == "zmq-tcp"]
    assert all({"prepare_ms", "commit_ms"} <= set(t) for t in zmq_timings)
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert sum(e["name"] == "migrate" for e in spans) == len(report["timeline"])
    assert sum(e["name"] == "import" for e in spans) == len(report["timeline"])
    assert png.stat().st_size > 10_000


def test_fit_overhead_recovers_a_line():
    rows = [{"bytes": b, "latency_ms_p50": 0.5 + 2.0 * b / 2**20, "kv_shape": "tiny"}
            for b in (4096, 65536, 1 << 20)] + [{"bytes": 64 << 20, "latency_ms_p50": 1e3, "kv_shape": "big"}]
    fit = fit_overhead(rows)
    assert fit["points"] == 3 and fit["max_bytes"] == 1 << 20
    assert fit["intercept_ms"] == pytest.approx(0.5) and fit["slope_ms_per_mib"] == pytest.approx(2.0)
    assert fit_overhead(rows[:1]) is None


def test_cheap_baselines_measure_something():
    assert baselines.memcpy(1 << 20, 2) > 0
    nixl = baselines.nixl(1 << 16, 1)
    try:
        import nixl as _  # noqa: F401
    except ImportError:
        assert nixl == {"gb_per_s": None, "note": "nixl not installed"}
    else:
        assert nixl["gb_per_s"] > 0 and nixl["verified"], nixl


def test_baselines_without_their_maker_are_refused():
    """measure.migrate holds no baseline of its own: asking for them without bench's maker is an error
    that says so, before anything starts."""
    from measure.migrate import QUICK, run_bench

    with pytest.raises(ValueError, match="baselines"):
        run_bench(QUICK)


def test_device_pools_refuse_the_ray_transports_and_only_device_runs_list_pinned_ratios():
    from dataclasses import replace

    from measure.migrate import QUICK, run_bench
    with pytest.raises(ValueError, match="zmq transports only"):
        run_bench(replace(QUICK, device="cuda", transports=("zmq-tcp", "ray")), baselines=baselines.Baselines)
    row = {"transport": "zmq-tcp", "kv_shape": "tiny", "tokens": 16, "bytes": 1 << 20, "gb_per_s": 2.0,
           "manifest_ratio": 1e-3, "latency_ms_p50": 0.5, "verified": True}
    host = [{"name": "raw_tcp", "bytes": 1 << 20, "gb_per_s": 4.0}]
    device = host + [{"name": "pinned_d2h", "bytes": 1 << 20, "gb_per_s": 50.0}]
    assert "vs_pinned_d2h" not in summarize({"results": [row], "baselines": host})["largest"][0]
    entry = summarize({"results": [row], "baselines": device})["largest"][0]
    assert entry["vs_pinned_d2h"] == pytest.approx(0.04) and entry["vs_raw_tcp"] == pytest.approx(0.5)
    assert "0.04x pinned_d2h" in format_summary(summarize({"results": [row], "baselines": device}))


def test_small_move_splits_the_critical_path(tmp_path):
    # bench.small_move: a real receiving process; every move is 3 messages and one ack, and the
    # segments of the path lie inside the whole move
    from bench import small_move

    assert small_move.main(["--tokens", "64", "--repeats", "20", "--json", str(tmp_path / "s.json")]) == 0
    r = json.loads((tmp_path / "s.json").read_text())
    two, one = r["two_processes_ms_p50"], r["in_process_us_p50"]
    assert r["payload_bytes"] == 64 * 2 * 2 * 2 * 16 * 2  # tiny: 2 layers, K and V, 2 heads, 16 dims, fp16
    assert r["machine"]["cpu"]
    assert 0 < two["export"] < two["total"] and 0 < two["ack sent -> sender has it"] < two["total"]
    assert 0 < two["manifest sent -> handled"] < two["total"]
    assert all(v > 0 for v in one.values()) and set(one) >= {"export", "commit", "land + verify"}
