"""`pdserve bench netns --serve`: `bench serve`'s open-loop load on one 1 prefill + 1 decode cluster
laid out two ways over namespaced Ray nodes (tests/netns_nodes.NetnsCluster; root only):
- two_nodes: the prefill worker on one node, the decode worker on another, so every prompt's KV
  crosses the decode node's veth (optionally shaped: `link_rate`, tbf both ways);
- one_node: both workers on one namespaced node (KV stays on that node's loopback and /dev/shm).
The head (root namespace; workers need their role's node resource, so none lands there) runs the
coordinator (`pdserve up --address HEAD --config deploy/multinode.yaml`, as the README tells users
to) and the load client. Each layout gets the same command, prompts (same seeds), rates and SLO, one
after another (never at once: both share this machine's cores); the bytes that crossed the decode
node's link are read from its veth counters. `start_up` is also what tests/test_netns_cluster.py
brings its clusters up with. What it cannot stand in for: real NICs (a veth is a copy in one
kernel), latency, separate CPUs.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from dataclasses import replace

from bench.netns import _harness
from measure.serve import QUICK, ServeBenchConfig, bench_target
from measure.serve_report import fmt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = ("two_nodes", "one_node")


def start_up(cluster, transport: str, model: str = "tiny", extra: tuple[str, ...] = (),
             timeout_s: float = 120.0) -> tuple[subprocess.Popen, int]:
    """`pdserve up` joined to the namespaced cluster, one worker per role, f32 weights (the local
    engine's); returns (process, HTTP port). The process is a session leader: kill its group."""
    cmd = [sys.executable, "-m", "pdserve_cli.main", "up", "--address", cluster.address, "--config",
           os.path.join(ROOT, "deploy", "multinode.yaml"), "--model", model, "--device", "cpu",
           "--prefill", "1", "--decode", "1", "--num-blocks", "128", "--host", "127.0.0.1", "--port", "0",
           "--transport", transport, "--weights", "f32", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**cluster.env(), "OMP_NUM_THREADS": "1"}, start_new_session=True)
    seen, found, deadline = "", None, time.monotonic() + timeout_s
    while found is None and time.monotonic() < deadline and proc.poll() is None:
        # all that arrived, not one line: lines left in a reader buffer are invisible to select
        if select.select([proc.stdout], [], [], 1.0)[0]:
            seen += os.read(proc.stdout.fileno(), 1 << 16).decode(errors="replace")
            found = re.search(r"on http://127\.0\.0\.1:(\d+)/v1", seen)
    if found is None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait(10)
        raise RuntimeError(f"pdserve up did not come up (exit {rc}):\n{seen}{proc.stdout.read()}")
    return proc, int(found.group(1))


def stop_up(proc: subprocess.Popen) -> None:
    """SIGTERM to `pdserve up`'s group (it shuts its workers down), SIGKILL after 30 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _specs(netns_nodes, layout: str) -> list:
    if layout == "two_nodes":
        return [netns_nodes.NodeSpec({"prefill_node": 1}), netns_nodes.NodeSpec({"decode_node": 1})]
    return [netns_nodes.NodeSpec({"prefill_node": 1, "decode_node": 1}, num_cpus=2)]


def run_layout(layout: str, cfg: ServeBenchConfig, transport: str, link_rate: str | None, log) -> dict:
    """One layout's cluster, brought up, measured at every rate of cfg, and torn down."""
    netns_nodes = _harness()
    specs = _specs(netns_nodes, layout)
    decode_node = len(specs) - 1
    with netns_nodes.NetnsCluster(specs, shm_mb=512) as cluster:
        cluster.connect()  # waits until every node is alive, so the workers' handshakes find them
        if link_rate:
            cluster.shape(decode_node, link_rate, burst="256kb")
        t0 = time.monotonic()
        proc, port = start_up(cluster, transport)
        try:
            log(f"== {layout} ({transport}, decode link {link_rate or 'unshaped'}): up on port {port} "
                f"in {time.monotonic() - t0:.1f} s ==")
            before = cluster.link_bytes(decode_node)
            runs, overhead = bench_target(f"http://127.0.0.1:{port}", "disaggregated",
                                          replace(cfg, url=f"http://127.0.0.1:{port}"), log)
            after = cluster.link_bytes(decode_node)
        finally:
            stop_up(proc)
    crossed = {k: after[k] - before[k] for k in after}
    log(f"  {layout}: {crossed['to_node'] / 1e6:.1f} MB into the decode node over its link")
    for r in runs:
        r["layout"] = layout
    return {"layout": layout, "link_rate": link_rate, "decode_link_bytes": crossed, "runs": runs,
            "overhead": overhead}


def run_bench(cfg: ServeBenchConfig = QUICK, transport: str = "zmq", link_rate: str | None = None,
              layouts: tuple[str, ...] = LAYOUTS, log=print) -> dict:
    """Every layout in turn under the same load; see the module docstring."""
    why = _harness().unavailable()
    if why:
        raise RuntimeError(why)
    for layout in layouts:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    results = [run_layout(layout, cfg, transport, link_rate if layout == "two_nodes" else None, log)
               for layout in layouts]
    return {"slo": {"ttft_ms": cfg.slo.ttft_ms, "tpot_ms": cfg.slo.tpot_ms},
            "config": {"preset": cfg.preset, "rates": list(cfg.rates), "num_requests": cfg.num_requests,
                       "transport": transport, "model": "tiny", "prefill": 1, "decode": 1,
                       "link_rate": link_rate, "quick": cfg.quick},
            "layouts": results}


def summary(report: dict) -> str:
    """One line per (layout, rate): TTFT/TPOT p50 and p99, goodput, and the one-node ratio."""
    lines = [f"{'layout':>9} {'rate':>5} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>7} "
             f"{'goodput':>8} {'mig p50':>8} {'failed':>6}  (ms; req/s)"]
    by_rate: dict = {}
    for lay in report["layouts"]:
        for r in lay["runs"]:
            by_rate.setdefault(r["rate"], {})[lay["layout"]] = r

    def cell(v, w, d=1):
        return f"{fmt(v, d):>{w}}"

    for rate, row in sorted(by_rate.items()):
        for layout, r in row.items():
            cells = (cell(r["ttft_ms"]["p50"], 9), cell(r["ttft_ms"]["p99"], 8),
                     cell(r["tpot_ms"]["p50"], 9, 2),
                     cell(r["tpot_ms"]["p99"], 7, 2), cell(r["goodput_req_s"], 8, 2),
                     cell(r["migration_ms"]["p50"], 8, 2), f"{r['failed']:6d}")
            lines.append(f"{layout:>9} {rate:5g} " + " ".join(cells))
        if len(row) == 2:
            a, b = row["two_nodes"]["ttft_ms"]["p50"], row["one_node"]["ttft_ms"]["p50"]
            if a and b:
                lines.append(f"{'':>9} {'':>5} two nodes / one node TTFT p50 {a / b:.2f}x")
    return "\n".join(lines)
