"""The migration benchmark's receiving process: `python -m measure.migrate_peer --control ADDR`.

It owns its own pool and a `ZmqReceiver`, so every measured transfer crosses a real socket
between two processes. The benchmark drives it over a REQ/REP control socket with msgpack
commands (no pickle): `setup` (pool + receiver, returns the bound address), `result` (digest and
timings of a committed import, then scrub and free it), `raw_tcp` (a listening sink that receives
N bytes per transfer into a preallocated, pre-touched buffer in 1 MiB `recv_into` pieces and
confirms each with one byte, over one reused connection: the raw loopback baseline),
`raw_tcp_digest` (xxh3 of that buffer, to verify the baseline), `stats`, `quit`. `PeerProcess`
is the benchmark's side: it spawns this module and drives it.

The pool is built exactly as the Ray receiver's (`measure.ray_receiver.PoolReceiver` as the
benchmark makes it): `measure.pools.make_manager` with prefix caching on and every page prefaulted,
and an import is released the same way (its unshared blocks scrubbed, then freed and uncached).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import xxhash
import zmq

from kvcache.storage import KVLayout
from measure.pools import kv_digest, make_manager
from measure.ray_receiver import release_import
from transfer.channels.zmq_receiver import ZmqReceiver
from transfer.errors import TransferError
from transfer.metrics import TransferMetrics
from transfer.transport import TransportConfig


class Peer:
    def __init__(self) -> None:
        self.rx: ZmqReceiver | None = None
        self.manager = None
        self.results: dict[str, object] = {}
        self.errors: list[str] = []
        self.metrics = TransferMetrics()

    def setup(self, cmd: dict) -> dict:
        if self.rx is not None:
            self.rx.close()
        self.results.clear()
        # NOTE: the same settings as measure.ray_receiver.PoolReceiver (prefix caching on, prefaulted).
        self.manager = make_manager(KVLayout(*cmd["layout"]), cmd["num_blocks"], prefix_caching=True,
                                    prefault=True, device=cmd.get("device", "cpu"))
        cfg = TransportConfig(address=cmd["address"], rcvhwm=cmd.get("rcvhwm", 32),
                              socket_buffer_bytes=cmd.get("socket_buffer_bytes", 4 << 20),
                              idle_timeout_s=cmd.get("idle_timeout_s", 30.0), secret=cmd.get("secret", ""))
        self.rx = ZmqReceiver(self.manager, cfg, metrics=self.metrics)
        with contextlib.suppress(ImportError, RuntimeError):  # nixl pool offers are read once this is loaded
            import transfer.channels.nixl  # noqa: F401
        return {"addresses": [self.rx.address] + [self.rx.bind(a) for a in cmd.get("more_addresses", [])]}

    def result(self, cmd: dict) -> dict:
        rid, deadline = cmd["request_id"], time.monotonic() + cmd.get("timeout", 30.0)
        while rid not in self.results and time.monotonic() < deadline:
            self.serve(0.01)
        res = self.results.pop(rid, None)
        if res is None:
            return {"ok": False, "errors": self.errors[-3:]}
        out = {"ok": True, "digest": kv_digest(self.manager, res.seq_id), "timings": res.timings,
               "new_blocks": res.new_blocks}
        release_import(self.manager, res.seq_id)
        return out

    def serve(self, timeout: float) -> None:
        if self.rx is None:
            time.sleep(timeout)
            return
        try:
            res = self.rx.poll(timeout)
        except TransferError as e:
            self.errors.append(f"{type(e).__name__}: {e}")
            return
        if res is not None:
            self.results[res.request_id] = res

    def stats(self) -> dict:
        if self.manager is not None:
            self.manager.check_integrity()
        return {"metrics": self.metrics.snapshot(), "errors": self.errors[-5:]}


_SINKS: dict[int, np.ndarray] = {}  # port -> the buffer of the latest raw_tcp sink


def raw_tcp_sink(nbytes: int, piece: int = 1 << 20, hashed: bool = False) -> dict:
    """Listen; a thread accepts one connection and, until it closes, receives `nbytes` per
    transfer into a pre-touched buffer (`recv_into` of at most `piece` bytes; hashed: each piece
    hashed with xxh3 once it has landed) and replies b"k"."""
    _SINKS.clear()  # one sink at a time: the previous size's buffer is released
    buf = np.ones(nbytes, dtype=np.uint8)  # touched: no page faults inside the measurement
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(60)
    port = srv.getsockname()[1]
    _SINKS[port] = buf

    def run():
        try:
            conn, _ = srv.accept()
        except OSError:
            srv.close()
            return
        srv.close()
        conn.settimeout(300)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mv = memoryview(buf)
        try:
            while True:
                for at in range(0, nbytes, piece):
                    got, end = at, min(at + piece, nbytes)
                    while got < end:
                        n = conn.recv_into(mv[got:end])
                        if n == 0:
                            return  # the benchmark closed the connection
                        got += n
                    if hashed:
                        xxhash.xxh3_64_intdigest(mv[at:end])
                conn.sendall(b"k")
        except OSError:
            return
        finally:
            conn.close()

    threading.Thread(target=run, daemon=True).start()
    return {"port": port}


def raw_tcp_digest(port: int) -> dict:
    buf = _SINKS.get(port)
    return {"digest": None if buf is None else xxhash.xxh3_64_intdigest(buf)}


class PeerProcess:
    """The receiving process for ZeroMQ points and the raw_tcp baseline, driven over REQ/REP."""

    def __init__(self, timeout: float = 120.0):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen([sys.executable, "-m", "measure.migrate_peer", "--control",
                                      f"tcp://127.0.0.1:{port}"], env=env)
        self.timeout = timeout
        self.call(cmd="ping")

    def call(self, **cmd) -> dict:
        self.sock.send(msgpack.packb(cmd, use_bin_type=True))
        deadline = time.monotonic() + self.timeout
        while not self.sock.poll(200):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"bench peer did not answer {cmd.get('cmd')!r} (exit {self.proc.poll()})")
        reply = msgpack.unpackb(self.sock.recv(), raw=False)
        if reply.get("error"):
            raise RuntimeError(f"bench peer: {reply['error']}")
        return reply

    def close(self) -> None:
        try:
            self.call(cmd="quit")
        except RuntimeError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.sock.close(0)
        self.ctx.term()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--control", required=True)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # as every worker (runtime.actor); see measure.migrate.run_bench
    ctx = zmq.Context()
    ctl = ctx.socket(zmq.REP)
    ctl.setsockopt(zmq.LINGER, 0)
    ctl.connect(args.control)
    peer = Peer()
    last_contact = time.monotonic()
    while time.monotonic() - last_contact < 600:  # the benchmark vanished: exit on our own
        if not ctl.poll(0):
            peer.serve(0.01)
            continue
        last_contact = time.monotonic()
        cmd = msgpack.unpackb(ctl.recv(), raw=False)
        try:
            name = cmd["cmd"]
            if name == "quit":
                ctl.send(msgpack.packb({"ok": True}))
                break
            handlers = {"setup": peer.setup, "result": peer.result, "stats": lambda c: peer.stats(),
                        "raw_tcp": lambda c: raw_tcp_sink(c["nbytes"], hashed=bool(c.get("hashed"))),
                        "raw_tcp_digest": lambda c: raw_tcp_digest(c["port"]), "ping": lambda c: {"ok": True}}
            reply = handlers[name](cmd)
        except Exception as e:  # report to the benchmark instead of dying silently
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        ctl.send(msgpack.packb(reply, use_bin_type=True))
    if peer.rx is not None:
        peer.rx.close()
    ctl.close(0)
    ctx.term()


if __name__ == "__main__":
    main()
