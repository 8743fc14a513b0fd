"""`pdserve bench netns`: KV migration across a link between machines of their own, on this one
machine (root only): tests/netns_nodes.NetnsCluster starts a Ray head in the root namespace on a
bridge and one Ray node in its own network and mount namespace (own address on a veth, own
/dev/shm). The sender is this process, on the head; the receivers are on the namespaced node, so
every byte crosses the node's veth (and its shaper):
- zmq-tcp: `measure.migrate_peer` started inside the node's namespaces, its KV receiver bound on the
  node's address (the same receiver and pool settings as `pdserve bench migrate`);
- ray: the `measure.ray_receiver.PoolReceiver` actor, placed on the node (the head has no CPU), the
  payload through Ray's object store (ray-store: the node cannot map the sender's pool file);
- nixl (when installed): ZeroMQ control, the node's NIXL agent reading the payload from the
  sender's registered pool over UCX, held to TCP (see run_bench);
- raw_tcp: a plain TCP stream of the same bytes into a pre-touched buffer on the node, one
  connection, `sendall` + a one-byte reply per transfer (the link's own ceiling).
Each rate in `rates` (tc syntax, e.g. 1gbit; "unlimited": no shaper) shapes the node's link both
ways (tbf) and measures every point (measure.migrate._run_layout: export -> wire -> import, digest
checked). Reported: GB/s at p50 per (rate, transport, tokens) and the ratio to raw_tcp.
What it cannot stand in for: real NICs (a veth is a memory copy in one kernel), latency, RDMA.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import torch

from measure.migrate import BenchConfig, _pct, _run_layout
from measure.migrate_peer import PeerProcess
from measure.pools import parse_kv_shape

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SINK = r"""
import socket, sys
ip, n = sys.argv[1], int(sys.argv[2])
srv = socket.socket(); srv.bind((ip, 0)); srv.listen(1); srv.settimeout(120)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept(); conn.settimeout(300)
buf = bytearray(n); mv = memoryview(buf)
while True:
    got = 0
    while got < n:
        k = conn.recv_into(mv[got:got + min(1 << 20, n - got)])
        if k == 0:
            sys.exit(0)
        got += k
    conn.sendall(b"k")
"""


def _harness():
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import netns_nodes

    return netns_nodes


def _in_node(cluster, i: int, argv: list[str], **kw) -> subprocess.Popen:
    """A process in node i's network namespace, with a /dev/shm of its own."""
    import shlex

    inner = " ".join(shlex.quote(a) for a in argv)
    script = f"mount -t tmpfs -o size={cluster.shm_mb}m tmpfs /dev/shm && exec {inner}"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(["ip", "netns", "exec", cluster.namespaces[i], "unshare", "--mount", "sh", "-c",
                             script], env=env, start_new_session=True, **kw)


class NodePeer(PeerProcess):
    """measure.migrate_peer inside node i's namespaces, driven from the head's address; its KV
    receiver binds on the node's address."""

    def __init__(self, cluster, i: int, timeout: float = 120.0):
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port(f"tcp://{cluster.head_ip}")
        self.node_ip, self.timeout = cluster.node_ip(i), timeout
        self.proc = _in_node(cluster, i, [sys.executable, "-m", "measure.migrate_peer", "--control",
                                          f"tcp://{cluster.head_ip}:{port}"])
        self.call(cmd="ping")

    def call(self, **cmd) -> dict:
        if cmd.get("cmd") == "setup":
            cmd.update(address=f"tcp://{self.node_ip}:0", more_addresses=[])
        return super().call(**cmd)


def raw_tcp(cluster, i: int, nbytes: int, repeats: int, warmup: int = 2) -> float:
    """GB/s at p50 of `nbytes` sent over one TCP connection to node i (a one-byte reply each)."""
    sink = _in_node(cluster, i, [sys.executable, "-c", SINK, cluster.node_ip(i), str(nbytes)],
                    stdout=subprocess.PIPE, text=True)
    try:
        port = int(sink.stdout.readline())
        payload = memoryview(bytearray(os.urandom(1 << 20)) * (nbytes >> 20) + bytearray(nbytes % (1 << 20)))
        lat = []
        with socket.create_connection((cluster.node_ip(i), port), timeout=120) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for r in range(warmup + repeats):
                t0 = time.perf_counter()
                s.sendall(payload)
                if s.recv(1) != b"k":
                    raise RuntimeError("raw TCP sink closed early")
                if r >= warmup:
                    lat.append(time.perf_counter() - t0)
        return nbytes / _pct(lat, 50) / 1e9
    finally:
        try:
            sink.wait(10)
        except subprocess.TimeoutExpired:
            sink.kill()
            sink.wait(5)


def run_bench(rates=("unlimited", "1gbit"), kv_shape: str = "llama3-8b", tokens=(256, 1024),
              repeats: int = 4, log=print) -> dict:
    """Every (rate, transport, tokens) point and raw_tcp at the same sizes; see the module doc."""
    netns_nodes = _harness()
    why = netns_nodes.unavailable()
    if why:
        raise RuntimeError(why)
    import ray

    from transfer.channels.nixl_pool import available

    # UCX (nixl) held to TCP here and in the node's processes, which inherit this environment: the
    # node shares this machine's PID and IPC namespaces, through which UCX would read the sender's
    # memory directly (CMA, SysV shm), past the link (netns_nodes.NetnsCluster.env says the same)
    os.environ.setdefault("UCX_TLS", "tcp,self")
    transports = ("zmq-tcp", "ray-store") + (("nixl",) if available() else ())
    if "nixl" not in transports:
        log("nixl is not installed: its row is skipped (pip install 'pdserve[nixl]')")
    L, H, D, dtype = parse_kv_shape(kv_shape)
    cfg = BenchConfig(kv_shapes=(kv_shape,), tokens=tuple(tokens), transports=transports,
                      repeats=repeats, warmup=2, small_repeats=repeats, small_warmup=2, baselines=False)
    rows, gen = [], torch.Generator().manual_seed(1234)
    spec = netns_nodes.NodeSpec({"receiver_node": 1}, num_cpus=1)
    with netns_nodes.NetnsCluster([spec], head_cpus=0, object_store_mb=1024, shm_mb=2048) as cluster:
        cluster.connect()
        peer = NodePeer(cluster, 0)
        # this process's UCX may use the bridge (UCX skips bridges unless told): without it, it
        # offers the node only loopback, which UCX refuses across namespaces
        os.environ.setdefault("UCX_TCP_BRIDGE_ENABLE", "y")
        try:
            for rate in rates:
                if rate == "unlimited":
                    cluster.unshape(0)
                else:
                    cluster.shape(0, rate, burst="256kb")
                start = time.monotonic()

                def progress(row, rate=rate, start=start):
                    row["rate"] = rate
                    log(f"[{rate} {time.monotonic() - start:5.1f}s] {row['transport']:9s} T={row['tokens']} "
                        f"{row['bytes'] / 1e6:.1f} MB: {row['gb_per_s']:.3f} GB/s (p50 "
                        f"{row['latency_ms_p50']:.1f} ms), verified={row['verified']}")

                before = cluster.link_bytes(0)
                found = _run_layout(cfg, peer, kv_shape, (L, H, D, 16, dtype), gen, progress, 64 << 20, None)
                crossed = cluster.link_bytes(0)["to_node"] - before["to_node"]
                for T in tokens:
                    nbytes = next(r["bytes"] for r in found if r["tokens"] == T)
                    gbps = raw_tcp(cluster, 0, nbytes, repeats)
                    log(f"[{rate}] raw_tcp   T={T} {nbytes / 1e6:.1f} MB: {gbps:.3f} GB/s")
                    for r in found:
                        if r["tokens"] == T:
                            r["raw_tcp_gb_per_s"], r["ratio_to_raw_tcp"] = gbps, r["gb_per_s"] / gbps
                    found.append({"rate": rate, "transport": "raw_tcp", "tokens": T, "bytes": nbytes,
                                  "gb_per_s": gbps})
                log(f"[{rate}] {crossed / 1e9:.2f} GB crossed the node's link during the migrations")
                rows += found
        finally:
            peer.close()
            ray.shutdown()
    return {"kv_shape": kv_shape, "link": "head (root namespace, on the bridge) -> namespaced node, one veth",
            "results": rows}


def summary(report: dict) -> str:
    names = ("zmq-tcp", "ray-store", "nixl")
    lines = [f"{'rate':>10} {'tokens':>6} {'MB':>7} " + " ".join(f"{n:>9}" for n in names)
             + f" {'raw_tcp':>8}  (GB/s; x raw)"]
    by = {}
    for r in report["results"]:
        by.setdefault((r["rate"], r["tokens"]), {})[r["transport"]] = r
    for (rate, T), row in by.items():
        raw = row["raw_tcp"]["gb_per_s"]
        cells = [f"{row[n]['gb_per_s']:9.3f}" if n in row else f"{'-':>9}" for n in names]
        ratios = ", ".join(f"{n} {row[n]['gb_per_s'] / raw:.2f}x" for n in names if n in row)
        lines.append(f"{rate:>10} {T:>6} {row['raw_tcp']['bytes'] / 1e6:7.1f} {' '.join(cells)} {raw:8.3f}  "
                     + ratios)
    return "\n".join(lines)
