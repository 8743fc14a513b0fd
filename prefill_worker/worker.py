"""The prefill worker: a Ray actor body owning one `LLMEngine(role='prefill')`.

A background thread owns the engine (every engine and pool call happens on it): it takes
requests and aborts from a command queue, steps the engine, pushes each step's first tokens
to the coordinator, then migrates every live sequence of each prefilled request over the
configured transport (`transfer/`) to the decode worker the coordinator chose, with the epoch
the coordinator gave, and releases its blocks (full ones stay in its prefix cache). Events
travel as one msgpack message per loop iteration over a ZeroMQ PUSH socket (no pickle, no Ray
call per token); actor methods take and return plain types only.

A migration that fails (timeout, transport error) does not free the request's blocks: the
request is *held* (reported with `held: true`) until the coordinator names another decode
worker with `resend(rid, name, address, epoch)`, which migrates the same blocks again (no
re-prefill). A held request's blocks are released when a resend succeeds, on `abort` or
`drop_held`, when a newer attempt of the request arrives, and after `hold_s` without a resend
(then an `err` of kind `hold_expired` is reported). Exports are tracked in a LeaseTable: a
failed transfer's lease is released at once (the held table still pins the blocks).

Event kinds (dicts inside {"w": name, "stats": {...}, "events": [...]}):
  tok  {rid, i (choice index), s (output position of the first token), t (tokens), f (finish)}
  mig  {rid, to, epoch, ms, bytes, blocks, reused, seqs, transport}    migration acked
  err  {rid, msg, kind, epoch, held}                                    request failed here
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass

import msgpack
import zmq

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillWorkerConfig:
    """name: the worker's id (also its Ray actor name). events_address: the coordinator's PULL socket.
    transport: 'zmq' or 'ray' (how KV travels to decode workers). namespace: Ray namespace of the
    decode actors (for the ray transport). engine: engine keyword arguments (model, block_size...;
    role is forced to 'prefill'). heartbeat_s: stats push period when idle. idle_poll_s: idle
    wait on the command queue. call_timeout_s: bound on any wait for the loop thread.
    transfer_timeout_s: bound on one migration's ack (and on a handshake). The loop thread waits
    for it, so it should stay below the coordinator's heartbeat timeout. hold_s: how long a
    request whose migration failed keeps its blocks waiting for a `resend` (0: never hold,
    release at once and report the failure without `held`)."""

    name: str
    events_address: str
    transport: str = "zmq"
    namespace: str = ""
    engine: dict | None = None
    heartbeat_s: float = 0.2
    idle_poll_s: float = 0.02
    call_timeout_s: float = 30.0
    transfer_timeout_s: float = 30.0
    hold_s: float = 30.0


class EventPusher:
    """One PUSH socket to the coordinator; used from the loop thread only."""

    def __init__(self, address: str, name: str, timeout_s: float = 5.0):
        self.name = name
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        self.sock.connect(address)
        self.last = 0.0

    def push(self, events: list[dict], stats: dict) -> None:
        try:
            self.sock.send(msgpack.packb({"w": self.name, "stats": stats, "events": events}))
            self.last = time.monotonic()
        except zmq.Again:
            log.warning("%s: coordinator not reading events; %d dropped", self.name, len(events))

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


class PrefillWorker:
    """Actor body: `ray.remote(PrefillWorker).remote(config_dict)`."""

    role = "prefill"

    def __init__(self, config: dict):
        import torch

        from engine.engine import EngineConfig, LLMEngine

        torch.set_num_threads(1)
        self.cfg = PrefillWorkerConfig(**config)
        if self.cfg.transport not in ("zmq", "ray"):
            raise ValueError(f"transport must be 'zmq' or 'ray', got {self.cfg.transport!r}")
        self.engine = LLMEngine(EngineConfig(**{**(self.cfg.engine or {}), "role": "prefill"}))
        self.fingerprint = self.engine.storage.layout.fingerprint()
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._reqs: dict[str, tuple] = {}       # rid -> (Request, decode worker, epoch)
        self._senders: dict[str, object] = {}   # decode worker name -> Sender
        self._held: dict[str, tuple[int, float]] = {}  # rid -> (failed epoch, deadline): awaiting resend
        from transfer.lease import LeaseTable
        self._leases = LeaseTable()
        self.prefills = self.resends = self.hold_expired = 0
        self._stop = threading.Event()
        self.failed: str | None = None
        self._stats = self._snapshot()
        self._thread = threading.Thread(target=self._loop, name=f"{self.cfg.name}-loop", daemon=True)
        self._thread.start()

    # ---- actor methods (plain types in and out) ---------------------------------------------
    def describe(self) -> dict:
        return {"name": self.cfg.name, "role": self.role, "address": "", "fingerprint": self.fingerprint,
                "block_size": self.engine.config.block_size, "model": self.engine.config.model,
                "max_context": self.engine.model_config.max_position_embeddings,
                "vocab_size": self.engine.model_config.vocab_size}

    def connect(self, decode_name: str, address: str) -> str | None:
        """Handshake with a decode worker now (layouts checked); an error message, or None."""
        return self._on_loop("connect", decode_name, address)

    def submit(self, rid: str, prompt_ids: list[int], params: dict, decode_name: str, decode_address: str,
               epoch: int, generated: list[int] | None = None) -> str | None:
        """Queue a request; returns an error message (the request is refused) or None.

        generated: output tokens already streamed (a resume after a decode worker was lost; n=1):
        they are prefilled with the prompt and sampling continues at their count, so a seeded
        stream goes on exactly as it would have."""
        from engine.engine import RequestError
        from engine.sampling import SamplingParams

        try:
            sp = SamplingParams.from_dict(params)
            self.engine.validate_prompt(list(prompt_ids), sp)  # read-only: safe off the loop thread
        except (RequestError, ValueError, TypeError) as e:
            return str(e)
        if generated and sp.n != 1:
            return "only single-choice requests can resume after a decode worker is lost"
        self._cmds.put(("add", rid, list(prompt_ids), sp, decode_name, decode_address, int(epoch),
                        list(generated or ()), None))
        return None

    def abort(self, rid: str) -> None:
        self._cmds.put(("abort", rid, None))

    def resend(self, rid: str, decode_name: str, decode_address: str, epoch: int) -> str | None:
        """Migrate a held request's blocks (its migration failed) to another decode worker under a new
        epoch; an error message when it is not held here (released, expired, aborted), else None."""
        return self._on_loop("resend", rid, decode_name, decode_address, int(epoch))

    def drop_held(self, rid: str, epoch: int) -> None:
        """Release a held request's blocks if it is held from the migration of `epoch` (a stale
        attempt the coordinator no longer wants); anything else is left alone."""
        self._cmds.put(("drop_held", rid, int(epoch), None))

    def stats(self) -> dict:
        return dict(self._stats)

    def inject_fault(self, kind: str) -> None:
        """Fault injection for tests: 'hang' stops the loop thread (no steps, no heartbeats) as a
        wedged process would; shutdown still ends it."""
        if kind != "hang":
            raise ValueError(f"unknown fault {kind!r}")
        self._cmds.put(("hang", None))

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(self.cfg.call_timeout_s)

    # ---- loop thread ------------------------------------------------------------------------
    def _on_loop(self, *cmd):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put((*cmd, fut))
        return fut.result(timeout=self.cfg.call_timeout_s)

    def _loop(self) -> None:
        self.events = EventPusher(self.cfg.events_address, self.cfg.name)
        try:
            while not self._stop.is_set():
                out: list[dict] = []
                self._drain(out, block=not self.engine.has_work())
                if self.engine.has_work():
                    self._tokens(self.engine.step(), out)
                if out and self.engine.prefilled:  # first tokens go out before the migrations
                    self.events.push(out, self._stats)
                    out = []
                for rid in list(self.engine.prefilled):
                    if rid not in self._held:
                        self._migrate(rid, out)
                self._expire_held(out)
                self._leases.expire()
                self._stats = self._snapshot()
                if out or time.monotonic() - self.events.last > self.cfg.heartbeat_s:
                    self.events.push(out, self._stats)
        except Exception as e:  # fail loudly: the coordinator sees the heartbeat stop
            log.exception("%s: loop failed", self.cfg.name)
            self.failed = f"{type(e).__name__}: {e}"
        finally:
            for name in list(self._senders):
                self._drop_sender(name)
            self.events.close()

    def _drain(self, out: list[dict], block: bool) -> None:
        while True:
            try:
                cmd = self._cmds.get(timeout=self.cfg.idle_poll_s) if block else self._cmds.get_nowait()
            except queue.Empty:
                return
            block = False
            kind, fut = cmd[0], cmd[-1]
            try:
                res = None
                if kind == "add":
                    self._add(*cmd[1:-1], out=out)
                elif kind == "abort":
                    self._reqs.pop(cmd[1], None)
                    self._held.pop(cmd[1], None)
                    self.engine.abort(cmd[1])
                elif kind == "resend":
                    res = self._resend(*cmd[1:-1])
                elif kind == "drop_held":
                    if self._held.get(cmd[1], (None,))[0] == cmd[2]:
                        self._held.pop(cmd[1])
                        self.engine.abort(cmd[1])
                elif kind == "connect":
                    res = self._connect(cmd[1], cmd[2])
                elif kind == "hang":
                    self._stop.wait()
                if fut is not None:
                    fut.set_result(res)
            except Exception as e:
                if fut is None:
                    raise
                fut.set_exception(e)

    def _add(self, rid, prompt_ids, params, decode_name, decode_address, epoch, generated, out) -> None:
        self._held.pop(rid, None)
        if rid in self.engine.requests or rid in self.engine.prefilled:
            self.engine.abort(rid)  # an earlier attempt of the same request: this one supersedes it
        try:
            self.engine.add_request(prompt_ids, params, request_id=rid)
        except Exception as e:  # validated already; a race with the pool
            out.append({"k": "err", "rid": rid, "msg": str(e), "kind": "refused", "epoch": epoch})
            return
        self.prefills += 1
        if generated:  # not scheduled yet: the first prefill computes prompt + generated
            self.engine.requests[rid].seqs[0].output_ids = list(generated)
        self._reqs[rid] = (self.engine.requests[rid], decode_name, decode_address, epoch)

    def _tokens(self, outputs, out: list[dict]) -> None:
        for o in outputs:
            entry = self._reqs.get(o.request_id)
            if entry is None:
                continue
            seq = next(s for s in entry[0].seqs if s.index == o.index)
            out.append({"k": "tok", "rid": o.request_id, "i": o.index,
                        "s": len(seq.output_ids) - len(o.new_token_ids), "t": list(o.new_token_ids),
                        "f": (o.finish_reason or "stop") if o.finished else None})
            if entry[0].finished:
                self._reqs.pop(o.request_id, None)  # every choice ended at its first token

    def _sender(self, decode_name: str, address: str):
        s = self._senders.get(decode_name)
        if s is None:
            from transfer.transport import TransportConfig

            tc = TransportConfig(address=address, peer_name=self.cfg.name,
                                 transfer_timeout_s=self.cfg.transfer_timeout_s,
                                 connect_timeout_s=min(10.0, self.cfg.transfer_timeout_s),
                                 checksum_mode="manifest" if self.cfg.transport == "ray" else "inline")
            if self.cfg.transport == "ray":
                import ray

                from transfer.ray_transport import RaySender
                s = RaySender(self.fingerprint, ray.get_actor(decode_name, namespace=self.cfg.namespace), tc)
            else:
                from transfer.zmq_transport import ZmqSender
                s = ZmqSender(self.fingerprint, tc)
            self._senders[decode_name] = s
        return s

    def _connect(self, decode_name: str, address: str) -> str | None:
        from transfer.errors import TransferError

        try:
            self._sender(decode_name, address).connect()
        except TransferError as e:
            self._drop_sender(decode_name)
            return f"{type(e).__name__}: {e}"
        return None

    def _drop_sender(self, decode_name: str) -> None:
        s = self._senders.pop(decode_name, None)
        if s is not None and hasattr(s, "close"):
            s.close()

    def _migrate(self, rid: str, out: list[dict]) -> None:
        """Ship every live sequence of a prefilled request; on the ack free our blocks (full ones stay
        cached). On a failure hold them for a `resend` (see the module docstring)."""
        from transfer.errors import TransferError
        from transfer.messages import DecodeState

        entry = self._reqs.pop(rid, None)
        req = self.engine.prefilled[rid]
        if entry is None:  # aborted meanwhile
            self.engine.release_prefilled(rid)
            return
        _, decode_name, address, epoch = entry
        t0 = time.perf_counter()
        stat = {"bytes": 0, "blocks": 0, "reused": 0, "seqs": 0}
        try:
            sender = self._sender(decode_name, address)
            state_sampling = req.params.to_dict()
            for s in req.live_seqs:
                state = DecodeState(list(s.token_ids), state_sampling, len(s.output_ids))
                ack = sender.migrate(self.engine.kv, s.seq_id, f"{rid}/{s.index}", epoch, state,
                                     leases=self._leases)
                stat["bytes"] += ack.nbytes
                stat["blocks"] += ack.new_blocks
                stat["reused"] += ack.reused_blocks
                stat["seqs"] += 1
        except (TransferError, OSError, RuntimeError, ValueError) as e:
            log.warning("%s: migration of %s to %s failed: %s", self.cfg.name, rid, decode_name, e)
            broken = not isinstance(e, TransferError) or type(e).__name__ in ("TransferTimeout",
                                                                               "HandshakeRequired")
            if broken:
                self._drop_sender(decode_name)  # the connection may be broken: reconnect next time
            for s in req.seqs:  # the unacked exports' extra references (the table still holds them)
                self._leases.release(f"{rid}/{s.index}", epoch)
            held = self.cfg.hold_s > 0
            if held:
                self._held[rid] = (epoch, time.monotonic() + self.cfg.hold_s)
            else:
                self.engine.release_prefilled(rid)
            out.append({"k": "err", "rid": rid, "epoch": epoch, "msg": f"migration to {decode_name} failed: "
                        f"{type(e).__name__}: {e}", "kind": "migration", "held": held})
            return
        self.engine.release_prefilled(rid)
        out.append({"k": "mig", "rid": rid, "to": decode_name, "epoch": epoch,
                    "ms": (time.perf_counter() - t0) * 1e3, "transport": self.cfg.transport, **stat})

    def _resend(self, rid: str, decode_name: str, address: str, epoch: int) -> str | None:
        if self._held.pop(rid, None) is None or rid not in self.engine.prefilled:
            return f"request {rid} is not held on {self.cfg.name}"
        self._reqs[rid] = (self.engine.prefilled[rid], decode_name, address, epoch)
        self.resends += 1
        return None  # the loop migrates it next

    def _expire_held(self, out: list[dict]) -> None:
        now = time.monotonic()
        for rid, (epoch, deadline) in list(self._held.items()):
            if deadline <= now:
                del self._held[rid]
                self.engine.abort(rid)
                self.hold_expired += 1
                out.append({"k": "err", "rid": rid, "epoch": epoch, "kind": "hold_expired",
                            "msg": f"no decode worker took the held KV within {self.cfg.hold_s:g}s"})

    def _snapshot(self) -> dict:
        e = self.engine
        return {"name": self.cfg.name, "role": self.role, "block_size": e.config.block_size, **e.kv.usage(),
                "queue_depth": len(e.scheduler.waiting), "running": len(e.scheduler.running),
                "preemptions": e.scheduler.preemptions, "active_requests": len(e.requests),
                "held_requests": len(e.prefilled), "steps": e.steps, "failed": self.failed,
                "held_for_resend": len(self._held), "prefills": self.prefills, "resends": self.resends,
                "hold_expired": self.hold_expired, "prefix_hit_tokens": e.kv.prefix_hit_tokens,
                "leases": len(self._leases)}
