"""`pdserve bench sim --jobs N`: the seeds split into contiguous shards, each in its own process,
the reports added up from JSON files. A seed runs alike in any process, so the totals equal one
process's."""

import json

from dst.parallel import shards
from pdserve_cli.main import main


def test_shards_cover_the_range_once_in_order():
    assert shards(10, 7, 3) == [(10, 3), (13, 2), (15, 2)]
    assert shards(0, 2, 4) == [(0, 1), (1, 1)]  # no empty shard
    parts = shards(5, 1001, 4)
    assert sum(n for _, n in parts) == 1001 and parts[0][0] == 5
    assert all(f + n == nf for (f, n), (nf, _) in zip(parts, parts[1:]))


def test_seeds_in_two_processes_add_up_to_one_process(tmp_path):
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    assert main(["bench", "sim", "--seeds", "120", "--first", "40", "--json", str(one)]) == 0
    assert main(["bench", "sim", "--seeds", "120", "--first", "40", "--jobs", "2", "--json", str(two)]) == 0
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    for key in ("seeds", "answered", "failed", "faults", "steps"):
        assert a[key] == b[key], key
    assert [s["first"] for s in b["shards"]] == [40, 100] and b["jobs"] == 2 and b["machine"]["cpu"]
