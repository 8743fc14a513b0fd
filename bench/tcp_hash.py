"""`python -m bench.tcp_hash [--json F]`: what checksumming costs a TCP stream on this machine.

The ZeroMQ bulk link (`transfer.channels.bulk_wire`) is a raw TCP socket plus an xxh3 of every 2 MiB
chunk on both ends: the sender hashes a chunk before sending it (the hash travels in the chunk's
header), the receiver while it lands. This bench strips it down to that: two processes, 256 MiB
sent in 2 MiB `sendall` calls into a pre-touched buffer, received in `--window` reads, with the
hash off, on the sender (before each chunk; or on a helper thread one chunk ahead), on the
receiver (each window right after it lands; or each whole chunk after it landed), or on both.
Each variant reports GB/s (median of its repeats) and the CPU seconds each process spent per GB
(user + system, `time.process_time`): when the plain stream already keeps both cores busy, a
hash has no idle core to hide on, and its CPU cost comes straight off the rate. Variants
alternate over rounds; it prints a line per variant and round, and writes JSON with the machine.
No pickle crosses the pipe: the receiver reports its CPU times as one JSON line.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

from transfer.checksum import checksum, hasher

NBYTES, CHUNK = 256 << 20, 2 << 20
VARIANTS = {  # name: (sender hashes: "", "inline" or "ahead"; receiver hashes: "", "window" or "chunk")
    "plain": ("", ""), "sender": ("inline", ""), "sender-ahead": ("ahead", ""),
    "receiver-window": ("", "window"), "receiver-chunk": ("", "chunk"), "both": ("inline", "window")}


def receiver(port: int, rx: str, window: int, repeats: int) -> None:
    """The peer process: receive `repeats` transfers, hashing as told; print CPU seconds as JSON."""
    conn = socket.create_connection(("127.0.0.1", port))
    dst = np.ones(NBYTES, dtype=np.uint8)
    view = memoryview(dst)
    cpu = []
    for _ in range(repeats):
        t0 = time.process_time()
        for off in range(0, NBYTES, CHUNK):
            h = hasher()
            for at in range(off, off + CHUNK, window):
                win, got = view[at:at + window], 0
                while got < window:
                    k = conn.recv_into(win[got:])
                    if k == 0:
                        raise SystemExit("sender closed")
                    got += k
                if rx == "window":
                    h.update(win)
            if rx == "chunk":
                checksum(view[off:off + CHUNK])
        cpu.append(time.process_time() - t0)
        conn.sendall(b"k")
    print(json.dumps({"cpu_s": cpu}), flush=True)


def run(variant: str, window: int, repeats: int) -> dict:
    tx, rx = VARIANTS[variant]
    srv = socket.create_server(("127.0.0.1", 0))
    peer = subprocess.Popen([sys.executable, "-m", "bench.tcp_hash", "--peer", str(srv.getsockname()[1]),
                             "--rx", rx, "--window", str(window), "--repeats", str(repeats)],
                            stdout=subprocess.PIPE, text=True)
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    src = np.random.default_rng(0).integers(1, 256, size=NBYTES, dtype=np.uint8)
    view = memoryview(src)
    ahead = concurrent.futures.ThreadPoolExecutor(1)
    secs, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        nxt = ahead.submit(checksum, view[:CHUNK]) if tx == "ahead" else None
        for off in range(0, NBYTES, CHUNK):
            if tx == "inline":
                checksum(view[off:off + CHUNK])
            elif nxt is not None:
                nxt.result()
                if off + CHUNK < NBYTES:
                    nxt = ahead.submit(checksum, view[off + CHUNK:off + 2 * CHUNK])
            conn.sendall(view[off:off + CHUNK])
        if conn.recv(1) != b"k":
            raise RuntimeError("the receiver closed early")
        secs.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    rx_cpu = json.loads(peer.communicate(timeout=60)[0])["cpu_s"]
    conn.close()
    srv.close()
    ahead.shutdown()
    gb = NBYTES / 1e9
    return {"variant": variant, "gb_per_s": gb / statistics.median(secs),
            "sender_cpu_s_per_gb": statistics.median(cpu) / gb,
            "receiver_cpu_s_per_gb": statistics.median(rx_cpu) / gb}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.tcp_hash", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5, help="transfers per variant and round")
    ap.add_argument("--window", type=int, default=256 << 10, help="receiver's read size in bytes")
    ap.add_argument("--json", help="write the rows and the machine here")
    ap.add_argument("--peer", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rx", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.peer:
        return receiver(a.peer, a.rx, a.window, a.repeats)
    if CHUNK % a.window:
        ap.error(f"--window must divide {CHUNK}")
    from measure.machine import describe, summary

    machine = describe()
    print(summary(machine), flush=True)
    rows = []
    for r in range(a.rounds):
        for v in VARIANTS:
            row = dict(run(v, a.window, a.repeats), round=r)
            rows.append(row)
            print(f"round {r} {v:16s} {row['gb_per_s']:.2f} GB/s, CPU s/GB sender "
                  f"{row['sender_cpu_s_per_gb']:.3f}, receiver {row['receiver_cpu_s_per_gb']:.3f}",
                  flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": machine, "window": a.window, "chunk": CHUNK, "bytes": NBYTES,
                       "rows": rows}, f, indent=1)
        print("wrote", a.json)


if __name__ == "__main__":
    main()
