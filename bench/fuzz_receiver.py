"""The receiver side of `pdserve bench fuzz`: a `ZmqReceiver` (data plane "stream", over a real
pool holding a resident sequence; with the run's cluster secret by default, so the HMAC path is
fuzzed) served by `receiver_main` in a spawned child process, and the parent's `Receiver` handle
on it. The child's loop frees every committed import (after taking its KV digest), reports
untyped exceptions (from `poll` or its threads) as crashes over the pipe, and on "check" waits for
in-flight transfers to time out, then compares the pool's allocator snapshot, its tables, open
file descriptors, threads and stream state with its starting baseline.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import threading
import time
import traceback
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.fuzz import FuzzConfig

SHAPE = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16"}  # 128 bytes a token
RX_BLOCK = 16
RX_NAME = "fuzz-rx"  # the receiver's peer_name: signed hellos are addressed to it


def _snapshot(manager):
    a = manager.allocator
    return (a.num_free, a.num_cached, a.num_used, sorted(manager.tables, key=str),
            [a.ref_count(b) for b in range(a.num_blocks)])


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _fd_targets() -> dict:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return out


def receiver_main(conn, num_blocks: int, idle_timeout_s: float, seed: int, secret: str = "") -> None:
    """Child process: serve a ZmqReceiver until told to stop; see the module doc."""
    import faulthandler

    import torch

    from kvcache.storage import KVLayout
    from measure.pools import fill_random_sequence, kv_digest, make_manager
    from transfer.channels.zmq_receiver import ZmqReceiver
    from transfer.errors import TransferError
    from transfer.metrics import TransferMetrics
    from transfer.transport import TransportConfig

    faulthandler.enable()
    lock = threading.Lock()

    def send(msg):
        with lock:
            conn.send(msg)

    def thread_hook(args):
        tb = "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
        send(("crash", f"thread {args.thread.name if args.thread else '?'}: {tb}"))

    threading.excepthook = thread_hook
    manager = make_manager(KVLayout(block_size=RX_BLOCK, **SHAPE), num_blocks)
    fill_random_sequence(manager, "resident", 40, torch.Generator().manual_seed(seed))
    metrics = TransferMetrics()
    config = TransportConfig(address="tcp://127.0.0.1:0", idle_timeout_s=idle_timeout_s,
                             connect_timeout_s=2.0, max_transfer_s=30.0, secret=secret, peer_name=RX_NAME)
    rx = ZmqReceiver(manager, config, metrics=metrics)
    rx.poll(0.5)  # the stream listener's accept thread opens its selector: part of the baseline
    base_snap, base_fds, base_threads = _snapshot(manager), _fds(), threading.active_count()
    base_targets = _fd_targets()
    digests: dict[str, int] = {}
    check_until = None
    send(("ready", rx.address))
    while True:
        result = None
        try:
            result = rx.poll(0.005)
        except TransferError:
            pass
        except Exception:  # noqa: BLE001 - an untyped exception escaping the receiver: a crash
            send(("crash", traceback.format_exc()))
        if result is not None:
            try:
                digests[result.request_id] = kv_digest(manager, result.seq_id)
                manager.free(result.seq_id)
            except Exception:  # noqa: BLE001
                send(("crash", "after commit: " + traceback.format_exc()))
        while conn.poll():
            cmd = conn.recv()
            if cmd == "check":
                check_until = time.monotonic() + 2 * idle_timeout_s + 5.0
            elif cmd == "stop":
                rx.close()
                send(("stopped", metrics.snapshot()))
                return
        if check_until is None:
            continue
        settled = (not rx.in_flight() and _fds() <= base_fds and threading.active_count() <= base_threads)
        if not settled and time.monotonic() < check_until:
            continue
        check_until = None
        leaks = []
        if rx.in_flight():
            leaks.append(f"transfers still in flight: {sorted(rx.in_flight())[:5]}")
        manager.allocator.evict_cached()
        snap = _snapshot(manager)
        if snap != base_snap:
            leaks.append(f"pool changed: free/cached/used {snap[:3]} vs {base_snap[:3]}, "
                         f"tables {snap[3][:5]}")
        try:
            manager.check_integrity()
        except Exception as e:  # noqa: BLE001
            leaks.append(f"integrity: {e}")
        if _fds() > base_fds:
            now = _fd_targets()
            new = sorted(f"{fd}->{tgt}" for fd, tgt in now.items() if base_targets.get(fd) != tgt)
            leaks.append(f"open file descriptors {_fds()} vs {base_fds} at start: {new[:8]}")
        if threading.active_count() > base_threads:
            leaks.append(f"threads {threading.active_count()} vs {base_threads} at start: "
                         f"{sorted(t.name for t in threading.enumerate())}")
        if rx.bulk is not None and (rx.bulk._expected or rx.bulk._open):
            leaks.append(f"bulk link state left: {len(rx.bulk._expected)} expected, "
                         f"{len(rx.bulk._open)} open")
        send(("check", {"leaks": leaks, "digests": digests, "metrics": metrics.snapshot()}))
        digests = {}


class Receiver:
    """The child process and its pipe."""

    def __init__(self, cfg: FuzzConfig, generation: int, secret: str = ""):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=receiver_main, args=(child, cfg.num_blocks, cfg.idle_timeout_s,
                                                            cfg.seed + generation, secret), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(120):
            raise RuntimeError("the fuzz receiver did not start")
        tag, self.address = self.conn.recv()
        assert tag == "ready"
        self.inbox: list = []

    def messages(self, tag: str) -> list:
        """Everything the child sent with this tag so far (others stay queued)."""
        with contextlib.suppress(EOFError, OSError):
            while self.conn.poll():
                self.inbox.append(self.conn.recv())
        got = [m for m in self.inbox if m[0] == tag]
        self.inbox = [m for m in self.inbox if m[0] != tag]
        return got

    def wait(self, tag: str, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.messages(tag)
            if got:
                return got[0]
            if not self.proc.is_alive():
                return None
            self.conn.poll(0.05)
        return None

    def stop(self):
        if self.proc.is_alive():
            with contextlib.suppress(OSError, EOFError, BrokenPipeError):
                self.conn.send("stop")
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()
