"""The Ray cluster behind the HTTP layer: `ClusterBackend`, same contract as `LocalEngineBackend`.

It creates and holds the prefill and decode worker actors (Ray must already be initialised; see
deploy.launch), checks at start that every prefill worker can hand KV to every decode worker
(the transport handshake compares layouts; an incompatible pair refuses to start with the
reason), and receives every worker's events on one asyncio ZeroMQ PULL socket (msgpack, one
message per worker step). Per request it picks a prefill and a decode worker (Router), moves
the ownership ledger (queued -> prefilling -> migrating -> decoding -> finished/failed, an epoch
per move), registers the migration epoch with the decode worker (which refuses any other),
and reorders token events by output position (the first token comes from the prefill worker,
the rest from the decode worker, over different sockets). Closing a request early aborts it on
both workers. A worker whose heartbeat stops counts as dead; with no live worker of a role a
request gets 503 at once. Failures: a request whose prefill worker is lost before migrating is
rerun on another prefill worker; one whose migration failed (its decode worker wedged or died
mid-transfer) has the blocks its prefill worker still holds re-sent to another decode worker
under a new epoch (no re-prefill); one whose decode worker is lost mid-decode is prefilled again
with the tokens already streamed (n=1; n>1 restarts, duplicates dropped) and continues on
another decode worker; with no replacement the client gets a 503 error (coordinator.failover).
Every wait is bounded.

Backpressure: before a request is prefilled, its decode worker must `reserve` room for the
migration (credit-based; see decode_worker.worker). A refusal is counted
(`pdserve_backpressure_refusals`) and the next decode worker is asked; when all refuse, the
request waits (short sleeps, at most `reserve_wait_s`) and then gets 503 "decode workers full".

Colocated mode (`ClusterConfig.colocated = K`): K workers each running both phases
(decode_worker.colocated), the baseline behind the same API, ledger (queued -> decoding on the
worker -> finished/failed; no migration), routing and metrics. A colocated worker that dies
fails its requests at once with 503; with none left, new requests get 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

import msgpack
import zmq
import zmq.asyncio

from coordinator.backend import FinalEvent
from coordinator.failover import FailoverMixin
from coordinator.ledger import Ledger, Phase
from coordinator.metrics import Metrics, worker_metrics_text
from coordinator.protocol import APIError, InternalError, InvalidRequest, ServiceUnavailable, Timeout
from coordinator.router import NoWorkerError, Router, WorkerLoad
from coordinator.workers import ROLES_COLOCATED, ROLES_DISAGGREGATED, spawn_workers
from coordinator.workers import RequestState as _Req
from coordinator.workers import WorkerState as _Worker
from coordinator.workers import call as _call

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterConfig:
    """prefill / decode: worker counts. transport: 'zmq' or 'ray'. model: 'tiny' or a checkpoint dir.
    block_size / decode_block_size: KV block sizes (decode_block_size 0: same as block_size).
    num_blocks: pool size per worker. engine: extra engine keyword arguments for both roles.
    host: interface the event socket and KV receivers bind (use a routable one across nodes).
    routing: Router policy. actor_cpus: Ray CPUs reserved per worker (fractional fits 2 cores).
    start_timeout_s: bound on workers loading and handshaking. call_timeout_s: bound on one
    control call. event_timeout_s: longest silence inside a request. heartbeat_timeout_s: a
    worker silent this long is dead (its requests fail with 503 at once). monitor_s: how often
    liveness is checked. name: served model name (default: model). prefill_resources /
    decode_resources: Ray custom resources each worker of the role requests, to place the roles on
    different nodes (e.g. {"prefill_node": 0.01} with nodes started `--resources '{"prefill_node": 1}'`).
    colocated: when > 0, run this many colocated workers (each does prefill and decode; no KV moves)
    instead of prefill/decode workers: prefill, decode, transport, decode_* are then ignored.
    decode_num_blocks: decode workers' pool size (0: num_blocks). reserve_wait_s: longest a request
    waits for room on a decode worker (backpressure) before it gets 503 "decode workers full".
    decode_model: the decode workers' model ('' : same as model); a model whose KV layout differs
    (layers, KV heads, head size, dtype) is refused at start, naming both workers and the fields."""

    prefill: int = 1
    decode: int = 1
    transport: str = "zmq"
    model: str = "tiny"
    block_size: int = 16
    decode_block_size: int = 0
    num_blocks: int = 512
    engine: dict = field(default_factory=dict)
    host: str = "127.0.0.1"
    routing: str = "least_loaded"
    actor_cpus: float = 0.25
    start_timeout_s: float = 180.0
    call_timeout_s: float = 10.0
    event_timeout_s: float = 60.0
    heartbeat_timeout_s: float = 5.0
    monitor_s: float = 0.25
    name: str | None = None
    prefill_resources: dict = field(default_factory=dict)
    decode_resources: dict = field(default_factory=dict)
    colocated: int = 0
    decode_num_blocks: int = 0
    reserve_wait_s: float = 30.0
    decode_model: str = ""


class ClusterBackend(FailoverMixin):
    """Prefill + decode actors behind the backend contract (see coordinator.backend)."""

    def __init__(self, config: ClusterConfig = ClusterConfig(), metrics: Metrics | None = None):
        from engine.config import ModelConfig
        from engine.loader import read_config
        from engine.tokenizer import load_tokenizer

        if config.transport not in ("zmq", "ray"):
            raise ValueError(f"transport must be 'zmq' or 'ray', got {config.transport!r}")
        if config.colocated < 0:
            raise ValueError(f"colocated must be >= 0, got {config.colocated}")
        if not config.colocated and (config.prefill < 1 or config.decode < 1):
            raise ValueError("a cluster needs at least one prefill and one decode worker")
        self.colocated = config.colocated > 0
        self.roles = ROLES_COLOCATED if self.colocated else ROLES_DISAGGREGATED
        self.config, self.metrics = config, metrics or Metrics()
        mc = ModelConfig.tiny() if config.model == "tiny" else read_config(config.model)
        self.tokenizer = load_tokenizer(None if config.model == "tiny" else config.model, mc)
        self.max_context, self.vocab_size = mc.max_position_embeddings, mc.vocab_size
        self.name = config.name or config.model
        self.namespace = f"pdserve-{uuid.uuid4().hex[:8]}"
        self.ledger = Ledger()
        self.routers = {role: Router(config.routing) for role in self.roles}  # one cycle per role
        self.workers: dict[str, _Worker] = {}
        self._reqs: dict[str, _Req] = {}
        self._reader: asyncio.Task | None = None
        self._monitor_task: asyncio.Task | None = None
        self._lost: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        self._ctx = self._pull = None
        self.events_address = ""

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> ClusterBackend:
        c = self.config
        self._ctx = zmq.asyncio.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        port = self._pull.bind_to_random_port(f"tcp://{c.host}")
        self.events_address = f"tcp://{c.host}:{port}"
        self._reader = asyncio.create_task(self._read_events())
        self.workers.update(spawn_workers(c, self.events_address, self.namespace))
        try:
            descs = await asyncio.wait_for(asyncio.gather(
                *(asyncio.wrap_future(w.handle.describe.remote().future()) for w in self.workers.values())),
                c.start_timeout_s)
        except asyncio.TimeoutError:
            await self.aclose()
            raise RuntimeError(f"workers did not start within {c.start_timeout_s}s") from None
        except Exception as e:
            await self.aclose()
            raise RuntimeError(f"a worker failed to start: {e}") from None
        for d in descs:
            w = self.workers[d["name"]]
            w.address, w.block_size, w.last_seen = d["address"], d["block_size"], time.monotonic()
            w.model = str(d.get("model", ""))
        if not self.colocated:
            await self._check_pairs()
        self._monitor_task = asyncio.create_task(self._monitor())
        return self

    async def _check_pairs(self) -> None:
        """Every prefill worker handshakes with every decode worker now: incompatible -> refuse."""
        for p in self._role("prefill"):
            for d in self._role("decode"):
                err = await _call(p.handle.connect.remote(d.name, d.address), self.config.start_timeout_s)
                if err:
                    await self.aclose()
                    raise RuntimeError(f"{p.name} (model {p.model}, block size {p.block_size}) cannot hand "
                                       f"KV to {d.name} (model {d.model}, block size {d.block_size}): {err}")

    async def aclose(self) -> None:
        import ray

        for w in self.workers.values():
            try:
                await _call(w.handle.shutdown.remote(), self.config.call_timeout_s)
            except Exception:  # dead or stuck: killing it below frees it anyway
                pass
            ray.kill(w.handle, no_restart=True)
        self.workers.clear()
        for task in (self._reader, self._monitor_task, *self._tasks):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._pull is not None:
            self._pull.close(0)
            self._ctx.term()
            self._pull = None
        for st in self._reqs.values():
            st.q.put_nowait(ServiceUnavailable("server shutting down"))

    # ---- the contract ---------------------------------------------------------------------------
    def model_names(self) -> list[str]:
        return [self.name]

    def _role(self, role: str) -> list[_Worker]:
        return [w for w in self.workers.values() if w.role == role]

    def _loads(self, role: str) -> list[WorkerLoad]:
        t, out = self.config.heartbeat_timeout_s, []
        for w in self._role(role):
            free = int(w.stats.get("free_blocks", 0)) + int(w.stats.get("cached_blocks", 0))
            out.append(WorkerLoad(w.name, free, int(w.stats.get("queue_depth", 0)), w.block_size, w.alive(t)))
        return out

    def health(self) -> tuple[bool, str]:
        t = self.config.heartbeat_timeout_s
        for role in self.roles:
            if not any(w.alive(t) for w in self._role(role)):
                return False, f"no live {role} worker"
        return True, "ok"

    def info(self) -> dict:
        t = self.config.heartbeat_timeout_s
        workers = [{"name": w.name, "role": w.role, "address": w.address, "block_size": w.block_size,
                    "alive": w.alive(t), **{k: v for k, v in w.stats.items() if k not in ("name", "role")}}
                   for w in self.workers.values()]
        return {"mode": "colocated" if self.colocated else "cluster", "model": self.name,
                "transport": None if self.colocated else self.config.transport,
                "routing": self.config.routing, "workers": workers, "ledger": self.ledger.summary()}

    def metrics_text(self) -> str:
        ws = self.workers.values()
        return worker_metrics_text([{**w.stats, "name": w.name, "role": w.role} for w in ws])

    def used_blocks(self) -> dict[str, int]:
        """Each worker's used blocks as last reported (prefix-cache entries are 'cached', not used)."""
        return {w.name: int(w.stats.get("used_blocks", 0)) for w in self.workers.values()}

    async def abort(self, request_id: str) -> None:
        st = self._reqs.get(request_id)
        if st is not None:
            self._drop(st, ok=False)
            st.q.put_nowait(ServiceUnavailable("request aborted"))

    async def submit(self, creq):
        params = creq.sampling_params().with_seed()
        prompt = list(creq.prompt_ids)
        try:
            if self.colocated:
                pname = dname = self.routers["colocated"].pick(self._loads("colocated"), "colocated", prompt)
            else:
                pname = self.routers["prefill"].pick(self._loads("prefill"), "prefill", prompt)
                dname = self.routers["decode"].pick(self._loads("decode"), "decode")
        except NoWorkerError as e:
            raise ServiceUnavailable(str(e)) from None
        rid = creq.request_id
        st = _Req(rid, creq.n, len(prompt), pname, dname, prompt, params.to_dict())
        self.ledger.open(rid)
        self._reqs[rid] = st
        try:
            await self._dispatch(st)
            while True:
                try:
                    ev = await asyncio.wait_for(st.q.get(), self.config.event_timeout_s)
                except asyncio.TimeoutError:
                    raise Timeout(f"no worker output for {self.config.event_timeout_s}s") from None
                if isinstance(ev, APIError):
                    raise ev
                yield ev
                if isinstance(ev, FinalEvent):
                    return
        finally:
            if rid in self._reqs:
                self._drop(st, ok=all(st.done))

    async def _dispatch(self, st: _Req) -> None:
        """Hand a request to its prefill worker, after registering its migration epoch with its
        decode worker (the MIGRATING move's epoch: one more than this PREFILLING move's), which must
        first reserve room for it (may switch st.decode, or wait). Colocated: the worker does it all."""
        if self.colocated:
            self.ledger.move(st.rid, Phase.DECODING, st.decode)
            call = self.workers[st.decode].handle.submit.remote(st.rid, st.prompt, st.params)
        else:
            epoch = st.epoch = self.ledger.get(st.rid).epoch + 2  # MIGRATING's, after PREFILLING's below
            await self._reserve(st, epoch)  # the ledger keeps the request queued while it waits for room
            self.ledger.move(st.rid, Phase.PREFILLING, st.prefill)
            d = self.workers[st.decode]
            call = self.workers[st.prefill].handle.submit.remote(st.rid, st.prompt, st.params, d.name,
                                                                 d.address, epoch, st.generated or None)
        try:
            err = await _call(call, self.config.call_timeout_s)
        except asyncio.TimeoutError:
            raise Timeout(f"a worker did not take the request within {self.config.call_timeout_s}s") from None
        except Exception as e:  # the actor died: mark it so routing skips it from now on
            name = st.decode if self.colocated else st.prefill
            self.workers[name].dead = type(e).__name__
            raise ServiceUnavailable(f"worker {name} failed: {type(e).__name__}") from None
        if err:
            raise InvalidRequest(err, param="prompt")

    async def _reserve(self, st: _Req, epoch: int) -> None:
        """Credit-based backpressure: a decode worker must admit the coming migration (st.decode
        first, then the others by free blocks); when all refuse, wait with short sleeps up to
        reserve_wait_s, then 503. Each refusal is counted."""
        c, tokens = self.config, len(st.prompt) + len(st.generated) + 1
        deadline, delay = time.monotonic() + c.reserve_wait_s, 0.01
        while st.rid in self._reqs:  # until dropped (client gone, aborted)
            loads = sorted((w for w in self._loads("decode")
                            if w.alive and w.worker_id not in self._lost | st.avoid),
                           key=lambda w: (w.worker_id != st.decode, -w.free_blocks))
            if not loads:
                raise ServiceUnavailable("no live decode worker")
            if all(st.n * (-(-tokens // w.block_size) + 1) > self.workers[w.worker_id].stats.get(
                    "total_blocks", 1 << 30) for w in loads):
                raise InvalidRequest(f"{st.n} x {tokens} tokens (+1 block each) exceed every decode "
                                     "worker's KV pool", param="prompt")
            for w in loads:
                handle = self.workers[w.worker_id].handle
                try:
                    call = handle.reserve.remote(st.rid, epoch, tokens, st.n, st.prefill)
                    ok = await _call(call, c.call_timeout_s)
                except asyncio.TimeoutError:
                    raise Timeout(f"decode worker {w.worker_id} did not answer within {c.call_timeout_s}s") \
                        from None
                except Exception as e:  # the actor died: say so now, not a heartbeat later, and go on
                    self.workers[w.worker_id].dead = type(e).__name__
                    continue
                if ok:
                    if st.rid not in self._reqs:  # dropped while we waited: give the credit back
                        handle.abort.remote(st.rid)
                        raise ServiceUnavailable("request aborted")
                    old, st.decode = self.workers.get(st.decode), w.worker_id
                    if old is not None and old.name != st.decode:  # an earlier attempt's credit there
                        old.handle.abort.remote(st.rid)
                    return
                self.metrics.count_backpressure(w.worker_id)
            if time.monotonic() > deadline:
                raise ServiceUnavailable(f"decode workers full: no room for the request within "
                                         f"{c.reserve_wait_s:g}s")
            await asyncio.sleep(delay)
            delay = min(0.2, delay * 2)
        raise ServiceUnavailable("request aborted")

    def _drop(self, st: _Req, ok: bool) -> None:
        """Forget a request; abort it on both workers unless it finished there."""
        self._reqs.pop(st.rid, None)
        self.ledger.close(st.rid, ok)
        for name in {st.prefill, st.decode} if not ok else (st.decode,):
            w = self.workers.get(name)
            if w is not None:
                w.handle.abort.remote(st.rid)  # fire and forget: nothing waits on it

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- events -----------------------------------------------------------------------------------
    async def _read_events(self) -> None:
        while True:
            data = await self._pull.recv()
            try:
                msg = msgpack.unpackb(data, raw=False)
                w = self.workers.get(msg["w"])
                if w is None:
                    continue
                w.stats, w.last_seen = dict(msg["stats"]), time.monotonic()
                for ev in msg["events"]:
                    self._on_event(w, ev)
            except Exception:  # a malformed message must not stop the reader
                log.exception("bad worker event message")
                self.metrics.count_error("bad_event")

    def _on_event(self, w: _Worker, ev: dict) -> None:
        st = self._reqs.get(ev.get("rid"))
        stale = st is None or w.name not in (st.prefill, st.decode) or ev.get("epoch", st.epoch) != st.epoch
        if stale:  # finished, aborted, or from an earlier attempt of this request
            if ev.get("held"):  # blocks held for a resend nobody will ask for: release them now
                w.handle.drop_held.remote(ev["rid"], int(ev["epoch"]))
            return
        kind = ev["k"]
        if kind == "tok":
            if w.name == st.decode:
                self._advance(st, Phase.DECODING)
            st.place(int(ev["i"]), int(ev["s"]), list(ev["t"]), ev.get("f"))
        elif kind == "mig":
            self._advance(st, Phase.MIGRATING)
            st.migration = {k: ev[k] for k in ("ms", "bytes", "blocks", "reused", "seqs", "transport", "to")}
            self.metrics.observe_migration(float(ev["ms"]), int(ev["bytes"]), int(ev["blocks"]),
                                           str(ev["transport"]))
        elif kind == "imp":
            self._advance(st, Phase.DECODING, int(ev.get("blocks", 0)))
        elif kind == "err" and ev.get("kind") == "migration":
            self.metrics.count_error("migration")
            if ev.get("held"):  # the prefill worker still holds the blocks: send them elsewhere
                self._spawn(self._resend(st, st.decode, str(ev.get("msg"))))
            else:
                self._resume(st, st.decode, str(ev.get("msg")))
            return
        elif kind == "err":
            self.metrics.count_error(str(ev.get("kind", "worker")))
            self._drop(st, ok=False)
            kind = ev.get("kind")
            cls = InvalidRequest if kind == "refused" else ServiceUnavailable if kind == "hold_expired" \
                else InternalError
            st.q.put_nowait(cls(f"{w.name}: {ev.get('msg')}"))
            return
        elif kind == "stale":
            self.metrics.count_error("stale_epoch")
        self._maybe_finish(st)

    def _advance(self, st: _Req, phase: Phase, blocks: int = 0) -> None:
        """Move the ledger forward to `phase`, through MIGRATING when events arrive out of order."""
        e = self.ledger.get(st.rid)
        order = [Phase.PREFILLING, Phase.MIGRATING, Phase.DECODING]
        if e is None or e.phase not in order or order.index(e.phase) >= order.index(phase):
            return
        for ph in order[order.index(e.phase) + 1:order.index(phase) + 1]:
            self.ledger.move(st.rid, ph, st.decode, blocks)
        st.decoded = st.decoded or phase is Phase.DECODING

    def _maybe_finish(self, st: _Req) -> None:
        if st.finished or not all(st.done) or (st.decoded and st.migration is None):
            return
        st.finished = True
        info = {"prefill_worker": st.prefill, "decode_worker": st.decode if st.decoded else None,
                "migration": st.migration, "resumed": st.resumed, "resent": st.resent}
        if self.colocated:
            info = {"worker": st.decode, "role": "colocated"}
        self._drop(st, ok=True)
        st.q.put_nowait(FinalEvent(st.prompt_tokens, info))
