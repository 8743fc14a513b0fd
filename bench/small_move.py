"""`python -m bench.small_move [--tokens 256] [--repeats 300] [--pin] [--json F]`: where a small
migration's time goes, on the critical path between two processes.

A sender (this process) moves one sequence of `--tokens` tokens of the `tiny` KV shape (64 KiB at
256 tokens, below `inline_bytes`: one manifest, one chunk, one end marker, one ack) to a
`ZmqReceiver` in a child process over zmq-tcp, `--repeats` times. Both sides stamp
`time.perf_counter` (CLOCK_MONOTONIC, one clock for every process on a machine) where a message
is sent and where it is handled, so each segment has a p50: the export; the manifest's send call
(how long until the sending thread runs again); send -> the receiver handles the manifest;
handling it; the chunk's and the end's handling, commit included; ack -> the sender; and, apart,
the receiver's own time in each message's handler (on the Zen 5 machine 0.21-0.26 ms for the
manifest against 67 us for its steps in one process: the same code, run cold between two
processes). The same protocol steps also run in one process without sockets (`inproc`: the CPU
each step costs when nothing waits). `--pin` places the two processes on two different cores
(`sched_setaffinity`; their threads, ZeroMQ's I/O threads included, inherit it). Both processes
run `--torch-threads` torch threads (1, as every worker): with 2, an idle OpenMP pool's threads
spin after each torch op and take the core an I/O thread needs (pinned, on the development
machine: 5.0 ms a move instead of 1.3). The child reports its stamps as one JSON line (nothing
pickled). JSON with the machine (measure.machine.describe).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import zmq

from kvcache.storage import KVLayout
from measure.machine import describe
from measure.pools import fill_random_sequence, make_manager, parse_kv_shape
from measure.ray_receiver import release_import
from transfer.channels.zmq_channel import ZmqChannel
from transfer.channels.zmq_receiver import ZmqReceiver
from transfer.checksum import checksum, copy_hashed
from transfer.export import ExportConfig, export_sequence
from transfer.importer import ImportSession
from transfer.reblock import check_compatible
from transfer.session import SenderSession
from transfer.transport import TransportConfig
from transfer.wire_codec import decode, encode, seal, unseal
from transfer.wire_messages import Ack, Manifest


def _manager(tokens: int, fill: bool):
    """A tiny-shaped pool with room for `tokens` tokens; `fill`: holding sequence "s" of them."""
    L, H, D, dt = parse_kv_shape("tiny")
    m = make_manager(KVLayout(L, H, D, 16, dt), tokens // 16 + 8, prefault=True)
    if fill:
        fill_random_sequence(m, "s", tokens, torch.Generator().manual_seed(0))
    return m


class _StampedReceiver(ZmqReceiver):
    """A ZmqReceiver that stamps each message it handles ("in") and each answer it sends ("out")."""

    stamps: list

    def _dispatch(self, ident, peer, parts):
        self.stamps.append(("in", time.perf_counter()))
        try:
            return super()._dispatch(ident, peer, parts)
        finally:
            self.stamps.append(("done", time.perf_counter()))

    def _deliver(self, ident, header, body):
        self.stamps.append(("out", time.perf_counter()))
        super()._deliver(ident, header, body)


def peer(tokens: int, repeats: int, cpu: int | None, threads: int) -> None:
    """The child: serve one handshake and `repeats` imports, then print the stamps as JSON."""
    torch.set_num_threads(threads)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    m = _manager(tokens, False)
    rx = _StampedReceiver(m, TransportConfig(address="tcp://127.0.0.1:0"))
    rx.stamps = []
    print(json.dumps({"address": rx.address}), flush=True)
    done = 0
    while done < repeats:
        res = rx.poll(0.05)
        if res is not None:
            release_import(m, res.seq_id)
            done += 1
    print(json.dumps({"stamps": rx.stamps}), flush=True)
    sys.stdin.readline()  # until the sender is done with us
    rx.close()


class _StampedSocket(zmq.Socket):
    stamps: list = []

    def send_multipart(self, msg_parts, *args, **kwargs):
        t0 = time.perf_counter()
        out = super().send_multipart(msg_parts, *args, **kwargs)
        self.stamps.append((t0, time.perf_counter()))
        return out


class _StampedContext(zmq.Context):
    _socket_class = _StampedSocket


class _StampedChannel(ZmqChannel):
    def _context(self):
        return _StampedContext(io_threads=self.config.io_threads)


def two_processes(tokens: int, repeats: int, pin: bool, threads: int) -> dict:
    """Segment p50s (ms) of `repeats` moves to a receiver in a child process."""
    child = subprocess.Popen([sys.executable, "-m", "bench.small_move", "--peer", "--repeats", str(repeats),
                              "--tokens", str(tokens), "--torch-threads", str(threads)]
                             + (["--cpu", "1"] if pin else []), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        address = json.loads(child.stdout.readline())["address"]
        if pin:
            os.sched_setaffinity(0, {0})
        m = _manager(tokens, True)
        cfg = TransportConfig(address=address)
        sender = SenderSession(m.storage.layout.fingerprint(), cfg, _StampedChannel(cfg))
        sender.connect()
        sends = _StampedSocket.stamps
        sends.clear()
        ecfg = ExportConfig(chunk_bytes=cfg.chunk_bytes, checksum_mode=cfg.checksum_mode)
        rows = []
        for i in range(repeats):
            t0 = time.perf_counter()
            ex = export_sequence(m, "s", f"r{i}", 1, config=ecfg)
            t1 = time.perf_counter()
            sender.send(ex)
            rows.append((t0, t1, time.perf_counter()))
            time.sleep(0.002)  # the receiver frees the import between moves
        stamps = json.loads(child.stdout.readline())["stamps"]
        child.stdin.write("\n")
        child.stdin.flush()
        sender.close()
    finally:
        if pin:
            os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
        child.wait(timeout=30)
    ins = [t for k, t in stamps if k == "in"][1:]  # without the hello
    dones = [t for k, t in stamps if k == "done"][1:]
    outs = [t for k, t in stamps if k == "out"][1:]
    if len(sends) != 3 * repeats or len(ins) != 3 * repeats or len(outs) != repeats:
        raise RuntimeError(f"expected 3 messages and 1 answer per move, got {len(sends)} sent, "
                           f"{len(ins)} handled, {len(outs)} answers for {repeats}")
    seg: dict[str, list[float]] = {}
    for i, (t0, t1, t2) in enumerate(rows[repeats // 10:], repeats // 10):  # the first tenth warms up
        (m0, m1), (d0, _), (e0, _) = sends[3 * i:3 * i + 3]
        hm, hd, he = ins[3 * i:3 * i + 3]
        dm, dd, de = dones[3 * i:3 * i + 3]
        for name, v in (("total", t2 - t0), ("export", t1 - t0), ("manifest send call", m1 - m0),
                        ("manifest sent -> handled", hm - m0), ("manifest handled -> chunk handled", hd - hm),
                        ("chunk sent -> handled", hd - d0), ("chunk handled -> end handled", he - hd),
                        ("end sent -> handled", he - e0), ("end handled -> ack sent", outs[i] - he),
                        ("ack sent -> sender has it", t2 - outs[i]),
                        ("  handling the manifest", dm - hm), ("  handling the chunk", dd - hd),
                        ("  handling the end (commit, ack)", de - he)):
            seg.setdefault(name, []).append(v * 1e3)
    return {k: statistics.median(v) for k, v in seg.items()}


def in_process(tokens: int, repeats: int) -> dict:
    """The same steps without sockets: per-step p50 (us), the CPU each one costs unhindered."""
    src, dst = _manager(tokens, True), _manager(tokens, False)
    fp = src.storage.layout.fingerprint()
    plan = check_compatible(fp, fp)
    ecfg = ExportConfig(chunk_bytes=2 << 20, checksum_mode="inline")
    steps: dict[str, list[float]] = {}

    def tick(name: str, t0: float) -> float:
        t = time.perf_counter()
        steps.setdefault(name, []).append((t - t0) * 1e6)
        return t

    for i in range(repeats + repeats // 10):
        t = time.perf_counter()
        ex = export_sequence(src, "s", f"r{i}", 1, config=ecfg)
        t = tick("export", t)
        body = seal(encode(ex.manifest))
        t = tick("encode + seal", t)
        pieces = [((f, c, checksum(view)), view) for f, c, view, _ in ex.chunks()]
        t = tick("chunk checksums", t)
        man = decode(unseal(body), expect=Manifest)
        t = tick("unseal + decode", t)
        s = ImportSession(dst, man, plan)
        t = tick("import session (validate, reserve)", t)
        for (f, c, cs), view in pieces:
            bufs = s.chunk_buffers(f, c)
            landed = copy_hashed(bufs, memoryview(view).cast("B"))
            s.chunk_done(f, c, view.nbytes, bufs, cs, landed_checksum=landed)
        t = tick("land + verify", t)
        r = s.commit()
        t = tick("commit", t)
        encode(Ack(r.request_id, r.epoch, r.new_blocks, r.reused_blocks, r.nbytes, r.timings))
        tick("ack", t)
        ex.release()
        release_import(dst, r.seq_id)
        if i == repeats // 10 - 1:
            steps.clear()
    return {k: statistics.median(v) for k, v in steps.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--pin", action="store_true", help="sender on core 0, receiver on core 1")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch threads in both processes (1)")
    ap.add_argument("--json")
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cpu", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.peer:
        peer(a.tokens, a.repeats, a.cpu, a.torch_threads)
        return 0
    threads = torch.get_num_threads()
    torch.set_num_threads(a.torch_threads)
    L, H, D, dt = parse_kv_shape("tiny")
    nbytes = a.tokens * KVLayout(L, H, D, 16, dt).token_bytes
    report = {"machine": describe(bandwidth=False), "tokens": a.tokens, "payload_bytes": nbytes,
              "repeats": a.repeats, "pinned": a.pin, "torch_threads": a.torch_threads}
    report["in_process_us_p50"] = inproc = in_process(a.tokens, a.repeats)
    print(f"in one process, {nbytes // 1024} KiB (p50 us): "
          + ", ".join(f"{k} {v:.0f}" for k, v in inproc.items()) + f"; sum {sum(inproc.values()):.0f}")
    report["two_processes_ms_p50"] = two = two_processes(a.tokens, a.repeats, a.pin, a.torch_threads)
    torch.set_num_threads(threads)
    print(f"two processes{' (pinned to cores 0 and 1)' if a.pin else ''}, p50 ms:")
    for k, v in two.items():
        print(f"  {k:36s} {v:6.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
