"""`pdserve bench blocksize` on a tiny run (two block sizes, a few requests): the JSON keeps the
issue's schema, counts add up, the engine's waste equals the simulator's where they model the same
thing (the seed trace at B=4, the mixed trace with an unlimited step budget), and the re-blocking
rows name their baselines. No timing is asserted."""

import json
import math

from pdserve_cli.main import main

KEYS = {"block_size", "admitted", "rejected", "preemptions", "peak_waste", "sim_peak_waste",
        "alloc_us_per_step", "attn_ms_per_step", "tpot_ms", "tokens_per_s", "cow_bytes", "prefix_hit_rate",
        "migration_ms"}


def test_blocksize_bench_schema_and_consistency(tmp_path, monkeypatch):
    import bench.blocksize as bb

    small = bb.BlocksizeConfig(sizes=(4, 16), capacity_tokens=512, mixed_requests=6, mixed_prompt=(4, 40),
                               mixed_output=(2, 12), shared_groups=2, shared_requests=4, shared_prefix=20,
                               shared_suffix=(2, 6), shared_n=2, shared_output=4, repeats=1,
                               migrate_sequences=2, migrate_repeats=1, reblock_pairs=((4, 16),))
    monkeypatch.setattr(bb, "quick", lambda cfg: (small, ["test-sized"]))
    out, fig = tmp_path / "b.json", tmp_path / "b.png"
    assert main(["bench", "blocksize", "--quick", "--sizes", "4,16", "--capacity-tokens", "512",
                 "--json", str(out), "--plot", str(fig)]) == 0
    report = json.loads(out.read_text())
    assert fig.stat().st_size > 0
    assert report["quick"] and report["shortened"] == ["test-sized"]
    assert [r["block_size"] for r in report["sizes"]] == [4, 16]
    for r in report["sizes"]:
        assert KEYS <= set(r)
        for k in KEYS - {"block_size"}:
            assert isinstance(r[k], (int, float)) and not math.isnan(r[k]) and r[k] >= 0, k
        assert 0.0 <= r["prefix_hit_rate"] <= 1.0
        for name, t in r["traces"].items():
            assert t["admitted"] + t["rejected"] == t["requests"], name
            assert t["completed"] == t["admitted"], name
            assert 0 <= t["peak_waste"] <= t["peak_reserved"], name
        assert r["admitted"] + r["rejected"] == 7  # the shipped seed trace
        # same requests, same accounting: the unchunked replay matches the simulator step by step
        mixed = r["traces"]["mixed_unchunked"]
        assert mixed["peak_waste"] == mixed["sim"]["peak_waste"]
        steps = mixed["waste_agreement"].split()[0].split("/")
        assert steps[0] == steps[1]
        assert r["traces"]["shared"]["cow_bytes"] == r["cow_bytes"]
    b4 = report["sizes"][0]
    assert b4["peak_waste"] == b4["sim_peak_waste"] == 8  # the seed's paged_4 row
    assert b4["traces"]["seed"]["waste_series"] == b4["traces"]["seed"]["sim_waste_series"]
    rb = {(x["src_block_size"], x["dst_block_size"]): x for x in report["reblocking"]}
    assert set(rb) == {(4, 16), (16, 16)}
    assert rb[(16, 16)]["vs_equal_src"] == 1.0
    assert rb[(4, 16)]["equal_src_ms"] == report["sizes"][0]["migration_ms"]
    assert set(report["minimizers"]) >= {"waste", "tpot", "migration"}
    assert report["minimizers"]["waste"] == 4 and report["answer"]
