"""runtime.priority: a worker sets the nice value of every thread it has (Linux keeps one per
thread), so an engine is not left at the 15 Ray starts workers at; and the embedded Ray starts its
workers at 0 (what a cluster's /v1/cluster shows per worker is checked in test_cluster_placement)."""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = """
import json, os, threading
from runtime.priority import set_niceness
stop = threading.Event()
threads = [threading.Thread(target=stop.wait) for _ in range(2)]
for t in threads: t.start()
got = set_niceness(7)  # a higher nice value: allowed without privileges
late = threading.Thread(target=stop.wait); late.start()  # started after: inherits it
nices = {}
for tid in os.listdir("/proc/self/task"):
    stat = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
    nices[tid] = int(stat[16])  # field 19 of stat: nice
stop.set()
print(json.dumps({"got": got, "nices": sorted(nices.values()), "unchanged": set_niceness(None)}))
"""


def test_every_thread_of_the_process_gets_the_nice_value():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60,
                         check=True)
    r = json.loads(out.stdout)
    assert r["got"] == 7 and r["unchanged"] == 7
    assert len(r["nices"]) >= 4 and set(r["nices"]) == {7}, r  # main, two before, one after
