"""The decode worker: a Ray actor body owning one `LLMEngine(role='decode')` and a transport receiver.

A background thread owns the engine and the receiver (every pool call happens on it). Each
iteration it serves the receiver briefly (handshakes, dedupe queries, imports), turns each
committed import into a `Sequence` and joins it to the continuous batch with `add_imported`
(only when its epoch is the one the coordinator registered for that request with `reserve`;
a stale or aborted import is freed at once, uncached), steps the engine, and pushes that step's
tokens to the coordinator as ONE msgpack message over ZeroMQ (not a Ray call per token).

Each migrated sequence travels under the transfer id "<request id>/<choice index>" and runs
as its own engine request with that id (its seed, index and output count keep sampling
identical to a colocated run). With the Ray transport the sender calls this actor's kv_*
methods; they are forwarded to the loop thread.

Credit-based backpressure: before a request is prefilled for this worker the coordinator calls
`reserve(rid, epoch, num_tokens, n, sender)`. It admits (and registers the epoch) only
if free + evictable (prefix-cache) blocks minus blocks already reserved can hold the n imported
sequences of num_tokens tokens plus one block of growth each; otherwise it returns False and the
coordinator picks another worker or waits. A reservation is consumed as its sequences are
imported, and released on abort, on a newer reservation for the request, or after
`reserve_ttl_s` (a prefill that never came), so credits never leak. The reservation is also the
receiver's admission (transfer.admission): a manifest or a dedupe query that no live
reservation names, for that epoch and from that sender, is refused before a block is allocated.

Event kinds: tok {rid, i, s, t, f} as from the prefill worker; imp {rid, i, blocks, ms} an
import joined the batch; stale {rid, epoch, expected} an import refused.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from prefill_worker.worker import EventPusher  # the same event socket for every role

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeWorkerConfig:
    """name: the worker's id (also its Ray actor name). events_address: the coordinator's PULL socket.
    transport: 'zmq' or 'ray'. kv_host: interface the ZeroMQ receiver binds (port picked freely).
    engine: engine keyword arguments (role forced to 'decode'). heartbeat_s: stats push period
    when idle. idle_poll_s: idle wait on the receiver / command queue. busy_poll_s: receiver
    wait between steps while decoding. call_timeout_s: bound on any wait for the loop thread.
    max_expected: bound on remembered request registrations. reserve_ttl_s: a reservation whose
    imports have not all arrived by then is released."""

    name: str
    events_address: str
    transport: str = "zmq"
    kv_host: str = "127.0.0.1"
    engine: dict | None = None
    heartbeat_s: float = 0.2
    idle_poll_s: float = 0.02
    busy_poll_s: float = 0.001
    call_timeout_s: float = 30.0
    max_expected: int = 100_000
    reserve_ttl_s: float = 60.0


@dataclass
class Reservation:
    """Credit for one request's coming migration (see `DecodeWorker.reserve`)."""

    epoch: int                # the migration epoch the coordinator issued
    sender: str               # the prefill worker that will send it
    blocks_left: int          # credit not yet turned into imported blocks
    blocks_per_sequence: int  # prompt blocks + one block of growth
    n: int                    # sequences (choices) the request migrates
    deadline: float           # monotonic time after which the credit is released
    sequences_left: int = field(default=-1)

    def __post_init__(self) -> None:
        if self.sequences_left < 0:
            self.sequences_left = self.n


class DecodeWorker:
    """Actor body: `ray.remote(DecodeWorker).options(name=...).remote(config_dict)`."""

    role = "decode"

    def __init__(self, config: dict):
        import torch

        from engine.engine import EngineConfig, LLMEngine
        from transfer.transport import TransportConfig, tcp_address

        torch.set_num_threads(1)
        self.cfg = DecodeWorkerConfig(**config)
        if self.cfg.transport not in ("zmq", "ray"):
            raise ValueError(f"transport must be 'zmq' or 'ray', got {self.cfg.transport!r}")
        self.engine = LLMEngine(EngineConfig(**{**(self.cfg.engine or {}), "role": "decode"}))
        tc = TransportConfig(address=tcp_address(_bind_host(self.cfg.kv_host), 0), peer_name=self.cfg.name)
        if self.cfg.transport == "zmq":
            from transfer.zmq_transport import ZmqReceiver
            self.receiver = ZmqReceiver(self.engine.kv, tc, admission=self)
            self.address = self.receiver.address
        else:
            from transfer.ray_transport import RayReceiverEndpoint
            self.receiver = RayReceiverEndpoint(self.engine.kv, tc, admission=self)
            self.address = f"ray://{self.cfg.name}"
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._expected: OrderedDict[str, list] = OrderedDict()  # rid -> [epoch, set of transfer ids]
        self._seqs: dict[str, tuple[str, object]] = {}          # transfer id -> (rid, Sequence)
        self._stop = threading.Event()
        self.failed: str | None = None
        self.refused = 0
        self._lock = threading.Lock()  # guards the credits below and the snapshot they are judged on
        self._reserved: dict[str, Reservation] = {}
        self._imports: list[tuple[str, int]] = []  # (rid, epoch) imported since the last snapshot
        self.refused_reservations = 0
        self._stats = self._snapshot()
        self._thread = threading.Thread(target=self._loop, name=f"{self.cfg.name}-loop", daemon=True)
        self._thread.start()

    # ---- actor methods (plain types) ----------------------------------------------------------
    def describe(self) -> dict:
        return {"name": self.cfg.name, "role": self.role, "address": self.address,
                "fingerprint": self.engine.storage.layout.fingerprint(),
                "block_size": self.engine.config.block_size, "model": self.engine.config.model}

    def reserve(self, rid: str, epoch: int, num_tokens: int, n: int = 1, sender: str = "") -> bool:
        """Admit a request's coming migration (n sequences of num_tokens tokens, from prefill worker
        `sender`) if room is left for it plus one block of growth per sequence. Only a reserved
        (request, epoch, sender) may send KV here or ask which blocks this worker holds."""
        if num_tokens < 1 or n < 1:
            raise ValueError(f"reserve needs num_tokens >= 1 and n >= 1, got {num_tokens}, {n}")
        per_seq = -(-int(num_tokens) // self.engine.config.block_size) + 1
        with self._lock:  # judged on the loop's last snapshot, which already counts consumed credits
            self._reserved.pop(rid, None)  # a newer attempt replaces the request's earlier credit
            self._expire()
            room = self._stats["free_blocks"] + self._stats["cached_blocks"] - self._reserved_blocks()
            if n * per_seq > room:
                self.refused_reservations += 1
                return False
            self._reserved[rid] = Reservation(int(epoch), str(sender), n * per_seq, per_seq, int(n),
                                              time.monotonic() + self.cfg.reserve_ttl_s)
        self._cmds.put(("expect", rid, int(epoch), None))  # queued before any import can arrive
        return True

    # ---- admission (transfer.admission), asked on the loop thread before anything is allocated ----
    def _reservation_for(self, transfer_id: str, peer: str):
        rid, _, idx = transfer_id.rpartition("/")
        r = self._reserved.get(rid)
        ok = r is not None and r.sender == peer and idx.isdigit() and int(idx) < r.n \
            and r.deadline > time.monotonic()
        return r if ok else None

    def admit_transfer(self, transfer_id: str, epoch: int, peer: str) -> bool:
        with self._lock:
            r = self._reservation_for(transfer_id, peer)
            return r is not None and r.epoch == epoch

    def admit_query(self, transfer_id: str, peer: str) -> bool:
        with self._lock:
            return self._reservation_for(transfer_id, peer) is not None

    def abort(self, rid: str) -> None:
        """Drop a request (any of its sequences, its registration, its credit); idempotent."""
        with self._lock:
            self._reserved.pop(rid, None)
        self._cmds.put(("abort", rid, None))

    def stats(self) -> dict:
        return dict(self._stats)

    def inject_fault(self, kind: str) -> None:
        """Fault injection for tests: 'hang' stops the loop thread (no imports served, no steps, no
        heartbeats) as a wedged process would; shutdown still ends it."""
        if kind != "hang":
            raise ValueError(f"unknown fault {kind!r}")
        self._cmds.put(("hang", None))

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(self.cfg.call_timeout_s)

    # Ray transport entry points (RaySender calls these), forwarded to the loop thread.
    def kv_hello(self, conn: str, data: bytes) -> bytes:
        return self._on_loop("kv", "kv_hello", conn, data)

    def kv_query(self, conn: str, data: bytes) -> bytes:
        return self._on_loop("kv", "kv_query", conn, data)

    def kv_receive(self, conn: str, manifest: bytes, *frames) -> bytes:
        return self._on_loop("kv", "kv_receive", conn, manifest, *frames)

    # ---- loop thread --------------------------------------------------------------------------
    def _on_loop(self, *cmd):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put((*cmd, fut))
        return fut.result(timeout=self.cfg.call_timeout_s)

    def _loop(self) -> None:
        from transfer.errors import TransferError

        self.events = EventPusher(self.cfg.events_address, self.cfg.name)
        try:
            while not self._stop.is_set():
                out: list[dict] = []
                busy = self.engine.has_work()
                wait = self.cfg.busy_poll_s if busy else self.cfg.idle_poll_s
                if self.cfg.transport == "zmq":
                    self._drain(out, None)
                    try:
                        res = self.receiver.poll(wait)
                        while res is not None:
                            self._drain(out, None)  # a registration queued before this import arrived
                            self._imported(res, out)
                            res = self.receiver.poll(self.cfg.busy_poll_s)
                    except TransferError as e:  # already nacked, counted and released by the receiver
                        log.warning("%s: import failed: %s", self.cfg.name, e)
                else:
                    self._drain(out, wait)
                if self.engine.has_work():
                    self._tokens(self.engine.step(), out)
                with self._lock:
                    self._consume()
                    self._expire()
                    self._stats = self._snapshot()
                if out or time.monotonic() - self.events.last > self.cfg.heartbeat_s:
                    self.events.push(out, self._stats)
        except Exception as e:
            log.exception("%s: loop failed", self.cfg.name)
            self.failed = f"{type(e).__name__}: {e}"
        finally:
            self.receiver_close()
            self.events.close()

    def receiver_close(self) -> None:
        if hasattr(self.receiver, "close"):
            self.receiver.close()

    def _drain(self, out: list[dict], block: float | None) -> None:
        while True:
            try:
                cmd = self._cmds.get(timeout=block) if block else self._cmds.get_nowait()
            except queue.Empty:
                return
            block = None
            kind, fut = cmd[0], cmd[-1]
            try:
                res = None
                if kind == "expect":
                    self._expected[cmd[1]] = [cmd[2], set()]
                    while len(self._expected) > self.cfg.max_expected:
                        self._expected.popitem(last=False)
                elif kind == "abort":
                    self._abort(cmd[1])
                elif kind == "hang":
                    self._stop.wait()
                elif kind == "kv":
                    self.receiver.last_result = None
                    res = getattr(self.receiver, cmd[1])(*cmd[2:-1])
                    if self.receiver.last_result is not None:
                        self._imported(self.receiver.last_result, out)
                        self.receiver.last_result = None
                if fut is not None:
                    fut.set_result(res)
            except Exception as e:
                if fut is None:
                    raise
                fut.set_exception(e)

    def _reserved_blocks(self) -> int:
        return sum(r.blocks_left for r in self._reserved.values())

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [rid for rid, r in self._reserved.items() if r.deadline < now]:
            del self._reserved[rid]

    def _consume(self) -> None:
        """Sequences imported since the last snapshot: their credit became real blocks (lock held)."""
        for rid, epoch in self._imports:
            r = self._reserved.get(rid)
            if r is None or r.epoch != epoch:
                continue
            r.blocks_left, r.sequences_left = r.blocks_left - r.blocks_per_sequence, r.sequences_left - 1
            if r.sequences_left <= 0:
                del self._reserved[rid]
        self._imports.clear()

    def _abort(self, rid: str) -> None:
        exp = self._expected.pop(rid, None)
        for tid in exp[1] if exp else ():
            self._seqs.pop(tid, None)
            self.engine.abort(tid)

    def _imported(self, res, out: list[dict]) -> None:
        from engine.sampling import SamplingParams
        from engine.sequence import Sequence

        rid, _, idx = str(res.request_id).rpartition("/")
        exp = self._expected.get(rid)
        if exp is None or exp[0] != res.epoch or not idx.isdigit():
            # stale, duplicate or aborted: nothing joins the batch, and no block of it stays cached
            self.engine.kv.free(res.seq_id, uncache=True)
            self.refused += 1
            out.append({"k": "stale", "rid": rid, "epoch": res.epoch, "expected": exp[0] if exp else None})
            return
        toks, gen = list(res.state.token_ids), res.state.num_generated
        seq = Sequence(int(idx), toks[:len(toks) - gen], toks[len(toks) - gen:], seq_id=res.seq_id)
        params = SamplingParams.from_dict(res.state.sampling)
        self.engine.add_imported(res.request_id, seq.prompt_ids, params, [seq])
        self._seqs[res.request_id] = (rid, seq)
        exp[1].add(res.request_id)
        self._imports.append((rid, res.epoch))  # its credit is consumed with the next snapshot
        out.append({"k": "imp", "rid": rid, "i": int(idx), "blocks": len(res.table.blocks),
                    "bytes": res.nbytes, "ms": float(sum(res.timings.values()))})

    def _tokens(self, outputs, out: list[dict]) -> None:
        for o in outputs:
            entry = self._seqs.get(o.request_id)
            if entry is None:
                continue
            rid, seq = entry
            start = len(seq.output_ids) - len(o.new_token_ids)
            out.append({"k": "tok", "rid": rid, "i": seq.index, "s": start, "t": list(o.new_token_ids),
                        "f": (o.finish_reason or "stop") if o.finished else None})
            if o.finished:
                self._seqs.pop(o.request_id, None)
                exp = self._expected.get(rid)
                if exp is not None:
                    exp[1].discard(o.request_id)

    def _snapshot(self) -> dict:
        e = self.engine
        return {"name": self.cfg.name, "role": self.role, "block_size": e.config.block_size, **e.kv.usage(),
                "queue_depth": len(e.scheduler.waiting), "running": len(e.scheduler.running),
                "preemptions": e.scheduler.preemptions, "active_requests": len(e.requests),
                "steps": e.steps, "refused_imports": self.refused, "failed": self.failed,
                "reserved_blocks": self._reserved_blocks(), "refused_reservations": self.refused_reservations}


def _bind_host(kv_host: str) -> str:
    """Loopback stays loopback (one machine); otherwise bind this node's own IP, since a decode
    worker may run on another node than the coordinator whose address `kv_host` names."""
    if kv_host in ("127.0.0.1", "localhost", "::1"):
        return kv_host
    import ray

    return ray.util.get_node_ip_address()
