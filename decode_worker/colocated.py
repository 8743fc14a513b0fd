"""The colocated worker: a Ray actor body owning one `LLMEngine(role='colocated')` that runs both phases.

It is the baseline `pdserve up --colocated K` serves (and the serving benchmark compares the
disaggregated cluster against): no KV ever moves. It lives with the decode worker because it is
a decode worker that also prefills; it reuses that worker's event pusher (`EventPusher`: one msgpack
message per loop iteration over ZeroMQ PUSH, the same {"w", "stats", "events"} envelope) and
its heartbeat rule (a stats-only push when nothing was sent for `heartbeat_s`).

A background thread owns the engine: it takes requests and aborts from a command queue, steps
the engine, and pushes that step's tokens as `tok {rid, i, s, t, f}` events (the format the
prefill and decode workers use, so the coordinator reorders them the same way). A request the
engine refuses gets `err {rid, msg, kind: 'refused'}`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from prefill_worker.worker import EventPusher

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ColocatedWorkerConfig:
    """name: the worker's id (also its Ray actor name). events_address: the coordinator's PULL socket.
    engine: engine keyword arguments (role forced to 'colocated'). heartbeat_s: stats push period
    when nothing else was sent. idle_poll_s: idle wait on the command queue. call_timeout_s: bound
    on joining the loop thread at shutdown."""

    name: str
    events_address: str
    engine: dict | None = None
    heartbeat_s: float = 0.2
    idle_poll_s: float = 0.02
    call_timeout_s: float = 30.0


class ColocatedWorker:
    """Actor body: `ray.remote(ColocatedWorker).options(name=...).remote(config_dict)`."""

    role = "colocated"

    def __init__(self, config: dict):
        import torch

        from engine.engine import EngineConfig, LLMEngine

        torch.set_num_threads(1)
        self.cfg = ColocatedWorkerConfig(**config)
        self.engine = LLMEngine(EngineConfig(**{**(self.cfg.engine or {}), "role": "colocated"}))
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._reqs: dict[str, object] = {}  # rid -> engine Request (kept after the engine retires it)
        self._stop = threading.Event()
        self.failed: str | None = None
        self._stats = self._snapshot()
        self._thread = threading.Thread(target=self._loop, name=f"{self.cfg.name}-loop", daemon=True)
        self._thread.start()

    # ---- actor methods (plain types) ----------------------------------------------------------
    def describe(self) -> dict:
        return {"name": self.cfg.name, "role": self.role, "address": "",
                "fingerprint": self.engine.storage.layout.fingerprint(),
                "block_size": self.engine.config.block_size, "model": self.engine.config.model}

    def submit(self, rid: str, prompt_ids: list[int], params: dict) -> str | None:
        """Queue a request; returns an error message (the request is refused) or None."""
        from engine.engine import RequestError
        from engine.sampling import SamplingParams

        try:
            sp = SamplingParams.from_dict(params)
            self.engine.validate_prompt(list(prompt_ids), sp)  # read-only: safe off the loop thread
        except (RequestError, ValueError, TypeError) as e:
            return str(e)
        self._cmds.put(("add", rid, list(prompt_ids), sp))
        return None

    def abort(self, rid: str) -> None:
        """Drop a request and free its blocks; idempotent."""
        self._cmds.put(("abort", rid))

    def stats(self) -> dict:
        return dict(self._stats)

    def inject_fault(self, kind: str) -> None:
        """Fault injection for tests: 'hang' stops the loop thread (no steps, no heartbeats)."""
        if kind != "hang":
            raise ValueError(f"unknown fault {kind!r}")
        self._cmds.put(("hang",))

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(self.cfg.call_timeout_s)

    # ---- loop thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        self.events = EventPusher(self.cfg.events_address, self.cfg.name)
        try:
            while not self._stop.is_set():
                out: list[dict] = []
                self._drain(out, block=not self.engine.has_work())
                if self.engine.has_work():
                    self._tokens(self.engine.step(), out)
                self._stats = self._snapshot()
                if out or time.monotonic() - self.events.last > self.cfg.heartbeat_s:
                    self.events.push(out, self._stats)
        except Exception as e:  # fail loudly: the coordinator sees the heartbeat stop
            log.exception("%s: loop failed", self.cfg.name)
            self.failed = f"{type(e).__name__}: {e}"
        finally:
            self.events.close()

    def _drain(self, out: list[dict], block: bool) -> None:
        while True:
            try:
                cmd = self._cmds.get(timeout=self.cfg.idle_poll_s) if block else self._cmds.get_nowait()
            except queue.Empty:
                return
            block = False
            if cmd[0] == "add":
                self._add(*cmd[1:], out=out)
            elif cmd[0] == "abort":
                self._reqs.pop(cmd[1], None)
                self.engine.abort(cmd[1])
            elif cmd[0] == "hang":
                self._stop.wait()

    def _add(self, rid: str, prompt_ids: list[int], params, out: list[dict]) -> None:
        if rid in self.engine.requests:
            self.engine.abort(rid)  # an earlier attempt of the same request: this one supersedes it
        try:
            self.engine.add_request(prompt_ids, params, request_id=rid)
        except Exception as e:  # validated already; a race with the pool
            out.append({"k": "err", "rid": rid, "msg": str(e), "kind": "refused"})
            return
        self._reqs[rid] = self.engine.requests[rid]

    def _tokens(self, outputs, out: list[dict]) -> None:
        for o in outputs:
            req = self._reqs.get(o.request_id)
            if req is None:
                continue
            seq = next(s for s in req.seqs if s.index == o.index)
            out.append({"k": "tok", "rid": o.request_id, "i": o.index,
                        "s": len(seq.output_ids) - len(o.new_token_ids), "t": list(o.new_token_ids),
                        "f": (o.finish_reason or "stop") if o.finished else None})
        for rid in {o.request_id for o in outputs}:
            if rid not in self.engine.requests:  # retired: every choice finished
                self._reqs.pop(rid, None)

    def _snapshot(self) -> dict:
        e = self.engine
        return {"name": self.cfg.name, "role": self.role, "block_size": e.config.block_size, **e.kv.usage(),
                "queue_depth": len(e.scheduler.waiting), "running": len(e.scheduler.running),
                "preemptions": e.scheduler.preemptions, "active_requests": len(e.requests),
                "steps": e.steps, "failed": self.failed}
