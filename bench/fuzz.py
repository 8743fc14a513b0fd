"""`pdserve bench fuzz`: mutated manifests, control messages and bulk links against a live
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

import random
import sys
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass

import msgpack

from bench import fuzz_mutators as M
from bench.fuzz_checks import FuzzChecks
from bench.fuzz_lanes import Hang, Lane, _run_stream_ops, _tokens_opened, reply_code  # noqa: F401
from bench.fuzz_receiver import RX_BLOCK, RX_NAME, SHAPE, Receiver, receiver_main  # noqa: F401
from bench.fuzz_templates import make_templates
from transfer.wire import TOKEN


@dataclass(frozen=True)
class FuzzConfig:
    cases: int = 1000
    seed: int = 0
    batch: int = 1000           # cases between leak checks
    idle_timeout_s: float = 1.0  # the receiver's idle timeout (ends abandoned transfers)
    hang_s: float = 10.0        # a reply later than this is a hang
    num_blocks: int = 1024      # receiver pool
    max_examples: int = 20      # failures kept in the report
    secret: bool = True         # the receiver checks signed hellos (the HMAC path is fuzzed too)



class Fuzzer(FuzzChecks):
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
        from protocol.curve import ClusterKeys

        self.secret = ClusterKeys.generate().secret if cfg.secret else ""

    # ---- receiver and lanes -----------------------------------------------------------------
    def _start(self) -> None:
        self.rx = Receiver(self.cfg, self.generation, self.secret)
        self.generation += 1

    def _lane(self, bs: int) -> Lane:
        lane = self.lanes.get(bs)
        if lane is None:
            lane = Lane(self.zctx, self.rx.address, self.fingerprints[bs], hang_s=self.cfg.hang_s,
                        secret=self.secret, receiver=RX_NAME)
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
        from transfer.wire_messages import Query

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

    def _dedupe_msgs(self, case, lane: Lane, token: int, replies: list) -> list:
        from transfer.export import export_sequence
        from transfer.wire import DATA
        from transfer.wire_codec import encode, seal
        from transfer.wire_messages import Query

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

    def _signed_hello(self, lane: Lane, edit: tuple) -> bytes:
        """A hello signed as the lane would sign it, then `edit` = (field, value) applied to its
        wire dict; ("replay", _): a main lane's last accepted hello, sent again."""
        field, value = edit
        if field == "replay":
            old = [x.last_hello for x in self.lanes.values() if x.last_hello]
            if old:
                return old[0]
        d = msgpack.unpackb(lane.hello_body(), raw=False)
        if field != "replay":
            d[field] = value
        try:
            return msgpack.packb(d, use_bin_type=True)
        except (OverflowError, TypeError, ValueError):  # a value msgpack cannot carry: send it unedited
            return lane.hello_body()

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
                           stream=case.stream_hello, hang_s=self.cfg.hang_s, secret=self.secret,
                           receiver=RX_NAME)
                if isinstance(case.hello, tuple):  # a signed hello with one field damaged (gen_hello)
                    case.hello = self._signed_hello(own, case.hello)
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


def run_fuzz(cfg: FuzzConfig, log=None) -> dict:
    return Fuzzer(cfg, log or (lambda s: print(s, file=sys.stderr, flush=True))).run()
