"""Many seeds on several cores: `run_seeds_in_processes` splits a range of seeds into contiguous
shards, runs each in its own `pdserve bench sim` process (the shard's report comes back as a JSON
file: nothing is pickled between processes), and adds the shards up. A seed's outcome does not
depend on which process ran it, so the totals equal one process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

TOTALS = ("seeds", "answered", "failed", "faults", "steps")


def shards(first: int, count: int, jobs: int) -> list[tuple[int, int]]:
    """`count` seeds from `first` as `jobs` contiguous (first, count) ranges, the larger ones first."""
    size, extra = divmod(count, jobs)
    out, at = [], first
    for j in range(jobs):
        n = size + (1 if j < extra else 0)
        if n:
            out.append((at, n))
        at += n
    return out


def run_seeds_in_processes(first: int, count: int, jobs: int, passthrough: list[str]) -> dict:
    """Seeds first..first+count-1 in `jobs` processes, each `pdserve bench sim --first F --seeds N`
    with `passthrough` (the run's other options); their progress goes to this stderr. Returns the
    summed totals, the wall-clock seconds and every shard's failures (by seed)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pdserve-sim-") as tmp:
        procs = []
        for j, (f, n) in enumerate(shards(first, count, jobs)):
            out = os.path.join(tmp, f"shard{j}.json")
            cmd = [sys.executable, "-m", "pdserve_cli.main", "bench", "sim", "--first", str(f),
                   "--seeds", str(n), "--json", out, *passthrough]
            procs.append((f, n, out, subprocess.Popen(cmd, stdout=subprocess.DEVNULL)))
        reports = []
        for f, n, out, proc in procs:
            proc.wait()
            if not os.path.exists(out):
                raise RuntimeError(f"the shard of seeds {f}..{f + n - 1} wrote no report "
                                   f"(exit status {proc.returncode})")
            with open(out) as fh:
                reports.append(json.load(fh))
    merged = {key: sum(r[key] for r in reports) for key in TOTALS}
    merged["seconds"] = time.perf_counter() - t0
    merged["failures"] = sorted((x for r in reports for x in r["failures"]), key=lambda x: x["seed"])
    merged["shards"] = [{"first": r["first"], "seeds": r["seeds"], "seconds": r["seconds"]} for r in reports]
    return merged
