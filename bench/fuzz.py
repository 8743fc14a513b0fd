"""`pdserve bench fuzz`: mutated manifests, control messages and data streams against a live
ZeroMQ receiver (mutation families: `bench.fuzz_mutators`).

The receiver (`ZmqReceiver`, data plane "stream", over a real pool holding a resident sequence)
runs in a child process; its loop frees every committed import (after taking its KV digest) and
reports over a pipe. Any Python exception other than a typed `TransferError` escaping `poll`,
or uncaught in one of its threads, is reported as a crash, and so is the child dying. The
parent drives cases over shared DEALER connections (one per sender block size; cases that
damage the handshake get their own), ends each zmq case with an end marker for every transfer it
opened and a dedupe query as a probe, and reads every reply up to the probe's: a probe that does
not come back within `hang_s` is a hang. Cases that only a receiver timeout can end (a vanished
sender, a stream that never claims its transfer) run on their own connections and are collected
at the next leak check. Every `batch` cases (and at the end) the parent closes its connections
and asks for a leak check: the child waits for in-flight transfers to time out, evicts the prefix
cache and compares the pool's allocator snapshot, its tables, open file descriptors and threads
with the ones it started with. Valid transfers (zmq, stream, dedupe) are mixed in: a nack or a
landed KV digest other than the source's is a false positive.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import socket
import sys
import threading
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass

import msgpack

from bench import fuzz_mutators as M
from transfer.zmq_wire import TOKEN

SHAPE = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16"}  # 128 bytes a token
RX_BLOCK = 16


@dataclass(frozen=True)
class FuzzConfig:
    cases: int = 1000
    seed: int = 0
    batch: int = 1000           # cases between leak checks
    idle_timeout_s: float = 1.0  # the receiver's idle timeout (ends abandoned transfers)
    hang_s: float = 10.0        # a reply later than this is a hang
    num_blocks: int = 1024      # receiver pool
    max_examples: int = 20      # failures kept in the report


# ---- the receiver (child process) ----------------------------------------------------------------
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


def receiver_main(conn, num_blocks: int, idle_timeout_s: float, seed: int) -> None:
    """Child process: serve a ZmqReceiver until told to stop; see the module doc."""
    import faulthandler

    import torch

    from bench.pools import fill_random_sequence, kv_digest, make_manager
    from kvcache.storage import KVLayout
    from transfer.errors import TransferError
    from transfer.metrics import TransferMetrics
    from transfer.transport import TransportConfig
    from transfer.zmq_transport import ZmqReceiver

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
                             connect_timeout_s=2.0, max_transfer_s=30.0)
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
        if rx.streams is not None and (rx.streams._expected or rx.streams._open):
            leaks.append(f"stream state left: {len(rx.streams._expected)} expected, "
                         f"{len(rx.streams._open)} open")
        send(("check", {"leaks": leaks, "digests": digests, "metrics": metrics.snapshot()}))
        digests = {}


class Receiver:
    """The child process and its pipe."""

    def __init__(self, cfg: FuzzConfig, generation: int):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=receiver_main, args=(child, cfg.num_blocks, cfg.idle_timeout_s,
                                                            cfg.seed + generation), daemon=True)
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


# ---- the sender side (this process) --------------------------------------------------------------
def reply_code(body: bytes) -> str:
    try:
        d = msgpack.unpackb(body, raw=False)
    except Exception:  # noqa: BLE001
        return "unparsable_reply"
    kind = d.get("kind") if isinstance(d, dict) else None
    if kind == "nack":
        return str(d.get("code"))
    return {"ack": "accepted", "held": "held", "hello_ok": "hello_ok"}.get(kind, f"reply:{kind}")


class Hang(Exception):
    pass


class Lane:
    """A DEALER connection to the receiver (and, when it asked for one, its data stream)."""

    def __init__(self, zctx, address: str, fingerprint: dict, stream: bool = True, hello="ok", hang_s=10.0):
        import zmq

        from transfer.messages import Hello

        self.zmq, self.hang_s, self.fingerprint, self.want_stream = zmq, hang_s, fingerprint, stream
        self.sock = zctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.host = "127.0.0.1"
        self.port, self.stream_token, self.streams = 0, b"", []
        self.token, self.owner = 0, {}
        self.hello_body = msgpack.packb(Hello(fingerprint, "fuzz", stream="tcp" if stream else "").to_wire(),
                                        use_bin_type=True)

    def hello(self) -> str:
        self.sock.send_multipart([b"H", self.hello_body])
        header, body = self.recv(lambda h: h == b"h")[-1]
        self.note_hello(body)
        return reply_code(body)

    def note_hello(self, body: bytes) -> None:
        with contextlib.suppress(Exception):
            d = msgpack.unpackb(body, raw=False)
            if d.get("kind") == "hello_ok" and d.get("data_token"):
                self.port, self.stream_token = d["data_port"], bytes.fromhex(d["data_token"])

    def recv(self, until, deadline: float | None = None) -> list:
        """Replies up to and including the first whose header satisfies `until`."""
        deadline = deadline or time.monotonic() + self.hang_s
        out = []
        while True:
            left = deadline - time.monotonic()  # past the deadline: only what already arrived
            if not self.sock.poll(max(0, int(left * 1000))):
                raise Hang(f"no reply within {self.hang_s}s")
            parts = self.sock.recv_multipart()
            header, body = parts[0], parts[-1]
            out.append((header, body))
            if until(header):
                return out

    def open_stream(self, mode: str):
        from transfer.stream_wire import OPEN, OPEN_MAGIC

        s = socket.create_connection((self.host, self.port), timeout=self.hang_s)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.streams.append(s)
        if mode == "ok":
            s.sendall(OPEN.pack(OPEN_MAGIC, self.stream_token))
            if s.recv(1) != b"K":
                raise Hang("the data stream did not open")
        elif mode == "token":
            s.sendall(OPEN.pack(OPEN_MAGIC, os.urandom(16)))
        elif mode == "magic":
            s.sendall(OPEN.pack(b"PDKVOPEM", self.stream_token))
        elif mode == "short":
            s.sendall(OPEN.pack(OPEN_MAGIC, self.stream_token)[:11])
        return s

    def close_streams(self):
        for s in self.streams:
            with contextlib.suppress(OSError):
                s.close()
        self.streams = []

    def close(self, linger: int = 0):
        self.close_streams()
        self.sock.close(linger)


def _tokens_opened(msgs) -> list[int]:
    """Tokens of the well-formed manifest headers among `msgs` (transfers the receiver may open)."""
    out = []
    for m in msgs:
        h = m[0]
        if len(m) == 2 and len(h) == TOKEN.size and h[:1] in (b"M", b"S"):
            t = TOKEN.unpack(h)[1]
            if t not in out:
                out.append(t)
    return out


def _run_stream_ops(lane: Lane, ops) -> None:
    s = lane.streams[-1] if lane.streams else None
    for op in ops or ():
        try:
            if op[0] == "open":
                s = lane.open_stream(op[1])
            elif op[0] == "bytes" and s is not None:
                s.sendall(op[1])
            elif op[0] == "zmq":
                lane.sock.send_multipart(op[1])
            elif op[0] == "close" and s is not None:
                s.close()
        except OSError:  # the receiver closed its end first: its verdict comes on the control channel
            pass


def make_templates(seed: int):
    """Valid transfers of real exported sequences (several lengths, frames, modes, block sizes)."""
    import torch

    from bench.pools import fill_random_sequence, kv_digest, make_manager
    from kvcache.storage import KVLayout
    from transfer.blocks import prefix_hashes_at
    from transfer.checksum import checksum
    from transfer.codec import encode
    from transfer.export import ExportConfig, export_sequence
    from transfer.messages import DecodeState

    gen = torch.Generator().manual_seed(seed)
    templates, sources = [], {}
    for bs, lengths in ((16, (1, 16, 17, 45, 100, 200)), (8, (9, 64, 130))):
        src = make_manager(KVLayout(block_size=bs, **SHAPE), 256)
        fill_random_sequence(src, "gap0", 2 * bs, gen)
        fill_random_sequence(src, "gap1", 2 * bs, gen)
        src.free("gap0", uncache=True)  # the next sequence starts in the hole: several frames
        for i, n in enumerate(lengths):
            seq = f"s{bs}_{n}"
            tokens = fill_random_sequence(src, seq, n, gen)
            state = DecodeState(tokens + [7], {"max_tokens": 64, "temperature": 0.7, "seed": 5 + i,
                                               "stop": ["</s>"], "stop_token_ids": [2]}, 1) if i % 2 else None
            for mode, cb in (("manifest", 4096), ("inline", 4096 if i % 2 else 8192)):
                ex = export_sequence(src, seq, "template", 1, state,
                                     config=ExportConfig(chunk_bytes=cb, checksum_mode=mode))
                chunks = [(f, c, bytes(v), checksum(v)) for f, c, v, _ in ex.chunks()]
                wire = msgpack.unpackb(encode(ex.manifest), raw=False)
                ex.release()
                t = M.Template(f"{seq}/{mode}/{cb}", wire, chunks, mode == "inline", bs, kv_digest(src, seq),
                               seq, prefix_hashes_at(tokens, RX_BLOCK))
                templates.append(t)
                sources[t.name] = (src, seq, ExportConfig(chunk_bytes=cb, checksum_mode=mode), state)
    return templates, sources


class Fuzzer:
    def __init__(self, cfg: FuzzConfig, log=None):
        import zmq

        self.cfg, self.log = cfg, log or (lambda s: None)
        self.zctx = zmq.Context()
        self.templates, self.sources = make_templates(cfg.seed)
        self.fingerprints = {t.block_size: t.wire["fingerprint"] for t in self.templates}
        self.generation = 0
        self.by = defaultdict(lambda: {"cases": 0, "refused_by_code": Counter(), "ops": Counter()})
        self.counts = Counter()
        self.examples: list[dict] = []
        self.expected: dict[str, tuple] = {}  # valid request id -> (digest, case index, family)
        self.pending: list = []
        self.rx_errors: Counter = Counter()
        self.lanes: dict[int, Lane] = {}
        self.rx = None

    # ---- bookkeeping ------------------------------------------------------------------------
    def _example(self, kind: str, index: int, case, detail: str) -> None:
        if len(self.examples) < self.cfg.max_examples:
            self.examples.append({"kind": kind, "case": index, "family": case.family if case else None,
                                  "op": case.op if case else None, "seed": self.cfg.seed,
                                  "template": case.template.name if case else None, "detail": detail[:4000]})

    def _crashes(self, index: int, case) -> None:
        for _, tb in self.rx.messages("crash"):
            self.counts["crashes"] += 1
            self._example("crash", index, case, tb)

    # ---- receiver and lanes -----------------------------------------------------------------
    def _start(self) -> None:
        self.rx = Receiver(self.cfg, self.generation)
        self.generation += 1

    def _lane(self, bs: int) -> Lane:
        lane = self.lanes.get(bs)
        if lane is None:
            lane = Lane(self.zctx, self.rx.address, self.fingerprints[bs], hang_s=self.cfg.hang_s)
            self.lanes[bs] = lane
            lane.hello()
        return lane

    def _close_lanes(self) -> None:
        for lane in self.lanes.values():
            lane.close()
        self.lanes = {}

    def _restart(self, index: int, case, why: str) -> None:
        alive = self.rx.proc.is_alive()
        self._crashes(index, case)
        if alive:
            self.counts["hangs"] += 1
            self._example("hang", index, case, why)
        else:
            self.counts["crashes"] += 1
            self._example("crash", index, case, f"receiver died (exit {self.rx.proc.exitcode}): {why}")
        self._close_lanes()
        for p in self.pending:
            p[1].close()
        self.pending = []
        self.expected = {}
        self.rx.stop()
        self._start()

    # ---- one case -----------------------------------------------------------------------------
    def _execute(self, case, lane: Lane, token: int) -> list[str]:
        """Send the case on `lane`; the codes of every reply it caused (probe excluded)."""
        replies = []
        if case.dedupe:
            case.msgs = self._dedupe_msgs(case, lane, token, replies)
        msgs = ([[b"H", case.hello]] if isinstance(case.hello, bytes) else []) + case.msgs
        opened = _tokens_opened(msgs)
        for t in opened:
            lane.owner[t] = case.family
        if case.stream is not None:
            _run_stream_ops(lane, case.stream[:1])  # the stream opens before the manifest is sent
        for m in msgs:
            lane.sock.send_multipart(m)
        if case.stream is not None:
            _run_stream_ops(lane, case.stream[1:])
        if case.lane == "pending":
            return replies
        if case.wait_token is not None:
            want = TOKEN.pack(b"A", case.wait_token)
            replies += lane.recv(lambda h: h == want)
        else:
            for t in opened:  # end every transfer the case may have opened: its verdict comes now
                lane.sock.send_multipart([TOKEN.pack(b"E", t), b""])
        from transfer.messages import Query

        probe = msgpack.packb(Query("probe", RX_BLOCK, ()).to_wire(), use_bin_type=True)
        lane.sock.send_multipart([b"Q", probe])
        need = 1 + sum(1 for m in msgs if len(m) == 2 and m[0] == b"Q")
        seen = 0

        def until(h):
            nonlocal seen
            seen += h == b"q"
            return seen >= need

        replies += lane.recv(until)[:-1]
        return self._codes(replies, lane, opened, case)

    def _codes(self, replies, lane: Lane, opened, case) -> list[str]:
        codes = []
        for header, body in replies:
            code = reply_code(body)
            if header[:1] == b"h":
                lane.note_hello(body)
            if header[:1] == b"A" and len(header) == TOKEN.size:
                t = TOKEN.unpack(header)[1]
                if t not in opened and (case.wait_token is None or t != case.wait_token):
                    fam = lane.owner.get(t)
                    if fam is None:  # a token no case of this connection opened (a damaged header's)
                        self.counts[f"late_unattributed:{code}"] += 1
                    else:
                        self.by[fam]["refused_by_code"][f"late:{code}"] += 1
                    continue
            codes.append(code)
        return codes

    def _dedupe_msgs(self, case, lane: Lane, token: int, replies: list) -> list:
        from transfer.codec import encode, seal
        from transfer.export import export_sequence
        from transfer.messages import Query
        from transfer.zmq_wire import DATA

        t = case.template
        lane.sock.send_multipart([b"Q", encode(Query(case.request_id, RX_BLOCK, tuple(t.hashes)))])
        header, body = lane.recv(lambda h: h == b"q")[-1]
        d = msgpack.unpackb(body, raw=False)
        packed = d["held"] if d.get("kind") == "held" else b""
        held = sorted({int.from_bytes(packed[i:i + 4], "little") for i in range(0, len(packed), 4)})
        replies.append((header, body))
        case.op = "reuse" if held else "no_reuse"
        src, seq, cfg, state = self.sources[t.name]
        ex = export_sequence(src, seq, case.request_id, 1, state, reuse=held,
                             reuse_block_size=RX_BLOCK if held else 0, config=cfg)
        try:
            from transfer.checksum import checksum

            inline = cfg.checksum_mode == "inline"
            msgs = [[TOKEN.pack(b"M", token), seal(encode(ex.manifest))]]
            msgs += [[DATA.pack(b"D", token, f, c, checksum(v) if inline else 0), bytes(v)]
                     for f, c, v, _ in ex.chunks()]
        finally:
            ex.release()
        return msgs + [[TOKEN.pack(b"E", token), b""]]

    def run_case(self, index: int) -> None:
        rng = random.Random(f"{self.cfg.seed}:{index}")
        family = M.pick_family(rng, index)
        t = rng.choice(self.templates)
        rid = f"fz{index}"
        if family == "valid_dedupe":
            t = rng.choice([x for x in self.templates if x.block_size == RX_BLOCK])
        lane = self.lanes.get(t.block_size) or self._lane(t.block_size)
        lane.token += 4
        token = lane.token
        if family in ("hello", "stream_slow", "abandon"):
            token = 1
        try:
            case = M.FAMILIES[family][0](rng, t, token, rid)
        except Exception:  # noqa: BLE001 - a bug of the fuzzer itself: counted, reported, skipped
            self.counts["generator_errors"] += 1
            if len(self.examples) < self.cfg.max_examples:
                self.examples.append({"kind": "generator_error", "case": index, "family": family,
                                      "seed": self.cfg.seed, "detail": traceback.format_exc()[-2000:]})
            return
        stats = self.by[family]
        stats["cases"] += 1
        stats["ops"][case.op.split("+")[0].split(":")[0]] += 1
        self.counts["cases"] += 1
        try:
            if case.lane == "main":
                codes = self._execute(case, lane, token)
                if any(len(m) == 2 and m[0] == b"H" for m in case.msgs) or case.family == "header":
                    lane.hello()  # the case may have cost this connection its handshake
            else:
                own = Lane(self.zctx, self.rx.address, self.fingerprints[t.block_size],
                           stream=case.stream_hello, hang_s=self.cfg.hang_s)
                if case.hello == "ok":
                    own.hello()
                if case.lane == "fresh":
                    try:
                        codes = self._execute(case, own, token)
                    finally:
                        own.close()
                else:
                    self._execute(case, own, token)
                    if case.vanish:  # gone once its messages left (linger), its stream too
                        own.close(linger=500)
                    self.pending.append((case, own, time.monotonic(), index))
                    codes = None
        except Hang as e:
            self._restart(index, case, f"{e} ({family}/{case.op})")
            return
        self._crashes(index, case)
        if codes is not None:
            self._record(index, case, codes)
        self._poll_pending()

    def _poll_pending(self) -> None:
        """Take the verdicts of pending cases that have arrived (their lateness is judged now)."""
        keep = []
        for entry in self.pending:
            case, lane, t0, index = entry
            if case.wait_token is None or not lane.sock.poll(0):
                keep.append(entry)
                continue
            try:
                want = TOKEN.pack(b"A", case.wait_token)
                replies = lane.recv(lambda h: h == want, time.monotonic())  # noqa: B023
            except Hang:
                keep.append(entry)
                continue
            late = time.monotonic() - t0 > 2 * self.cfg.idle_timeout_s + self.cfg.hang_s
            if late:
                self.counts["hangs"] += 1
                self._example("hang", index, case, "the verdict of an abandoned transfer came late")
            self._record(index, case, self._codes(replies, lane, [case.wait_token], case))
            lane.close()
        self.pending = keep

    def _record(self, index: int, case, codes: list[str]) -> None:
        stats = self.by[case.family]
        for code in sorted(set(codes)) or ["silent"]:
            stats["refused_by_code"][code] += 1
        if case.valid:
            bad = [c for c in codes if c not in ("accepted", "held")]
            if bad or codes.count("accepted") != 1:
                self.counts["false_positives"] += 1
                self._example("false_positive", index, case, f"replies {codes}")
            else:
                self.expected[case.request_id] = (case.template.digest, index, case)

    # ---- leak check ---------------------------------------------------------------------------
    def _collect_pending(self) -> None:
        for case, lane, t0, index in self.pending:
            try:
                if case.wait_token is not None:
                    want = TOKEN.pack(b"A", case.wait_token)
                    deadline = t0 + 2 * self.cfg.idle_timeout_s + self.cfg.hang_s
                    replies = lane.recv(lambda h: h == want, deadline)  # noqa: B023
                    self._record(index, case, self._codes(replies, lane, [case.wait_token], case))
                else:
                    self._record(index, case, ["unobserved"])
            except Hang as e:
                self.counts["hangs"] += 1
                self._example("hang", index, case, f"no verdict for an abandoned transfer: {e}")
            finally:
                lane.close()
        self.pending = []

    def leak_check(self, index: int) -> None:
        self._collect_pending()
        self._close_lanes()
        got = None
        with contextlib.suppress(OSError):
            self.rx.conn.send("check")
            got = self.rx.wait("check", 4 * self.cfg.idle_timeout_s + 30)
        self._crashes(index, None)
        if got is None:
            self._restart(index, None, "no answer to a leak check")
            return
        report = got[1]
        self.counts["leak_checks"] += 1
        if report["leaks"]:
            self.counts["leaks"] += 1
            self._example("leak", index, None, "; ".join(report["leaks"]))
        self.rx_errors = Counter(report["metrics"]["errors"])
        self.rx_counters = report["metrics"]["counters"]
        digests = report["digests"]
        for rid, (digest, i, case) in self.expected.items():
            if digests.get(rid) != digest:
                self.counts["false_positives"] += 1
                self._example("false_positive", i, case,
                              f"landed digest {digests.get(rid)} != source {digest}")
        self.expected = {}

    # ---- the run ------------------------------------------------------------------------------
    def run(self) -> dict:
        t0 = time.monotonic()
        self._start()
        try:
            for i in range(self.cfg.cases):
                self.run_case(i)
                if (i + 1) % self.cfg.batch == 0 or i + 1 == self.cfg.cases:
                    self.leak_check(i)
                    rate = (i + 1) / (time.monotonic() - t0)
                    self.log(f"fuzz: {i + 1}/{self.cfg.cases} cases, {rate:.0f}/s; "
                             f"crashes {self.counts['crashes']}, hangs {self.counts['hangs']}, "
                             f"leaks {self.counts['leaks']}, "
                             f"false positives {self.counts['false_positives']}")
        finally:
            self._close_lanes()
            for p in self.pending:
                p[1].close()
            self.rx.stop()
            self.zctx.term()
        return self.report(time.monotonic() - t0)

    def report(self, seconds: float) -> dict:
        return {
            "cases": self.counts["cases"], "crashes": self.counts["crashes"], "hangs": self.counts["hangs"],
            "leaks": self.counts["leaks"], "false_positives": self.counts["false_positives"],
            "leak_checks": self.counts["leak_checks"], "generator_errors": self.counts["generator_errors"],
            "seed": self.cfg.seed, "seconds": round(seconds, 1),
            "by_mutation": {k: {"cases": v["cases"],
                                "refused_by_code": dict(sorted(v["refused_by_code"].items())),
                                "ops": dict(sorted(v["ops"].items()))} for k, v in sorted(self.by.items())},
            "late_unattributed": {k.split(":", 1)[1]: v for k, v in sorted(self.counts.items())
                                  if k.startswith("late_unattributed:")},
            "receiver_errors": dict(sorted(self.rx_errors.items())),
            "receiver_counters": dict(sorted(getattr(self, "rx_counters", {}).items())),
            "templates": [t.name for t in self.templates],
            "examples": self.examples,
        }


def run_fuzz(cfg: FuzzConfig, log=None) -> dict:
    return Fuzzer(cfg, log or (lambda s: print(s, file=sys.stderr, flush=True))).run()
