"""What the HTTP layer needs from whatever runs the model, and the in-process implementation.

The contract is duck-typed (no base class; a second implementation, the Ray cluster, plugs in
with the same methods and attributes):

    tokenizer                     encode(text) -> list[int], decode(ids) -> str
    max_context: int              prompt + max_tokens may not exceed it
    vocab_size: int               prompt ids must be below it
    async def submit(creq)        an async iterator of events for one CompletionRequest (its
                                  prompt_ids filled): TokenEvent(index, token_ids,
                                  finish_reason) per choice and batch, finish_reason set on
                                  each choice's last one, then one FinalEvent(prompt_tokens,
                                  info). It raises protocol.APIError subclasses (InvalidRequest,
                                  ServiceUnavailable("no live prefill worker"), ...), before
                                  the first event where it can. Closing the iterator early
                                  (client gone, stop string found upstream) must abort the
                                  request and free its blocks everywhere.
    async def abort(request_id)   abort a request by id (idempotent)
    def model_names() -> list[str]    served names; the first is the default
    def info() -> dict            the /v1/cluster body (workers, ledger, ...)
    def health() -> (bool, str)   liveness and a one-line reason
    def metrics_text() -> str     extra Prometheus text (e.g. metrics.worker_metrics_text)

`LocalEngineBackend` owns one colocated LLMEngine and runs its step loop in a dedicated
thread. Every engine call happens on that thread: requests and aborts reach it through a
command queue, and each step's outputs go back to the waiting coroutines' asyncio queues with
`loop.call_soon_threadsafe`, one call per request per step. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass

from coordinator.metrics import worker_metrics_text
from coordinator.protocol import APIError, InternalError, InvalidRequest, ServiceUnavailable, Timeout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenEvent:
    """New tokens of choice `index`; finish_reason ('stop', 'length') on its last event."""

    index: int
    token_ids: tuple[int, ...]
    finish_reason: str | None = None


@dataclass(frozen=True)
class FinalEvent:
    """The request is done on the backend. info: backend facts for the client (worker,
    preemptions, migration...), JSON-safe."""

    prompt_tokens: int
    info: dict


@dataclass(frozen=True)
class LocalBackendConfig:
    """name: the model name served (None: the engine's model spec, e.g. 'tiny').
    accept_timeout_s: bound on the engine thread taking a new request.
    event_timeout_s: bound on the wait for a request's next step output.
    idle_poll_s: how long the idle engine thread sleeps on its command queue at a time.
    close_timeout_s: bound on joining the engine thread at close()."""

    name: str | None = None
    accept_timeout_s: float = 30.0
    event_timeout_s: float = 120.0
    idle_poll_s: float = 0.05
    close_timeout_s: float = 10.0


class _Sink:
    """Where one request's outputs go: an asyncio queue on the submitting coroutine's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, n: int, prompt_tokens: int):
        self.loop, self.q = loop, asyncio.Queue()
        self.remaining, self.prompt_tokens = n, prompt_tokens
        self.req = None  # the engine's Request (for its preemption count)

    def put(self, item) -> bool:
        try:
            self.loop.call_soon_threadsafe(self.q.put_nowait, item)
            return True
        except RuntimeError:  # the loop is closed: nobody listens any more
            return False


class LocalEngineBackend:
    """One in-process colocated engine behind the backend contract (see module docstring)."""

    def __init__(self, engine_config=None, *, engine=None, config: LocalBackendConfig = LocalBackendConfig()):
        from engine.engine import EngineConfig, LLMEngine

        self.config = config
        self.engine = engine if engine is not None else LLMEngine(engine_config or EngineConfig())
        self.name = config.name or self.engine.config.model
        self.tokenizer = self.engine.tokenizer
        self.max_context = self.engine.model_config.max_position_embeddings
        self.vocab_size = self.engine.model_config.vocab_size
        self.aborted = 0
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}
        self._stop = threading.Event()
        self._failed: str | None = None
        self._stats = self._snapshot()
        self._thread = threading.Thread(target=self._loop, name="pdserve-engine", daemon=True)

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> LocalEngineBackend:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.config.close_timeout_s)

    def __enter__(self) -> LocalEngineBackend:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the contract ---------------------------------------------------------------------
    def model_names(self) -> list[str]:
        return [self.name]

    def health(self) -> tuple[bool, str]:
        if self._failed:
            return False, f"engine failed: {self._failed}"
        if not self._thread.is_alive():
            return False, "engine thread is not running"
        return True, "ok"

    def info(self) -> dict:
        s = self._stats
        return {"mode": "local", "model": self.name, "workers": [s],
                "ledger": {"active_requests": s["active_requests"], "owned_blocks": s["used_blocks"]},
                "aborted_requests": self.aborted}

    def metrics_text(self) -> str:
        return worker_metrics_text([self._stats])

    async def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))

    async def submit(self, creq):
        from engine.engine import RequestError
        ok, why = self.health()
        if not ok:
            raise ServiceUnavailable(why)
        params = creq.sampling_params()
        rid = creq.request_id
        sink = _Sink(asyncio.get_running_loop(), creq.n, len(creq.prompt_ids))
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(("add", rid, list(creq.prompt_ids), params, sink, accepted))
        done = False
        try:
            try:
                await asyncio.wait_for(asyncio.wrap_future(accepted), self.config.accept_timeout_s)
            except RequestError as e:
                done = True  # never entered the engine
                raise InvalidRequest(str(e), param="prompt") from None
            except asyncio.TimeoutError:
                raise Timeout(f"the engine did not take the request within {self.config.accept_timeout_s}s") \
                    from None
            while True:
                try:
                    batch = await asyncio.wait_for(sink.q.get(), self.config.event_timeout_s)
                except asyncio.TimeoutError:
                    raise Timeout(f"no engine output for {self.config.event_timeout_s}s") from None
                if isinstance(batch, APIError):
                    done = True
                    raise batch
                for ev in batch:
                    if isinstance(ev, FinalEvent):
                        done = True
                    yield ev
                if done:
                    return
        finally:
            if not done:
                self._cmds.put(("abort", rid))

    # ---- the engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_work())
                if self.engine.has_work():
                    self._deliver(self.engine.step())
                self._stats = self._snapshot()
        except Exception as e:  # a broken engine: fail loudly, fail every waiter, free what we can
            log.exception("engine step loop failed")
            self._failed = f"{type(e).__name__}: {e}"
            self._fail_all(InternalError(f"engine failed: {self._failed}"))
            return
        self._fail_all(ServiceUnavailable("server shutting down"))

    def _drain(self, block: bool) -> None:
        while True:
            try:
                cmd = self._cmds.get(timeout=self.config.idle_poll_s) if block else self._cmds.get_nowait()
            except queue.Empty:
                return
            block = False
            if cmd[0] == "add":
                self._add(*cmd[1:])
            else:
                self._abort(cmd[1])

    def _add(self, rid, prompt_ids, params, sink: _Sink, accepted: concurrent.futures.Future) -> None:
        try:
            self.engine.add_request(prompt_ids, params, request_id=rid)
        except Exception as e:  # RequestError (bad prompt, pool too small) or a duplicate id
            accepted.set_exception(e)
            return
        sink.req = self.engine.requests.get(rid)
        self._sinks[rid] = sink
        accepted.set_result(rid)

    def _abort(self, rid: str) -> None:
        self._sinks.pop(rid, None)
        if self.engine.abort(rid):
            self.aborted += 1

    def _deliver(self, outputs) -> None:
        by_req: dict[str, list] = {}
        for o in outputs:
            by_req.setdefault(o.request_id, []).append(o)
        for rid, outs in by_req.items():
            sink = self._sinks.get(rid)
            if sink is None:
                continue
            batch: list = []
            for o in outs:
                reason = (o.finish_reason or "stop") if o.finished else None
                batch.append(TokenEvent(o.index, tuple(o.new_token_ids), reason))
                sink.remaining -= int(o.finished)
            if sink.remaining <= 0:
                del self._sinks[rid]
                pre = sink.req.num_preemptions if sink.req is not None else 0
                batch.append(FinalEvent(sink.prompt_tokens, {"worker": "local-0", "preemptions": pre}))
            if not sink.put(batch):
                self._abort(rid)

    def _fail_all(self, err: APIError) -> None:
        for rid, sink in list(self._sinks.items()):
            sink.put(err)
            try:
                self.engine.abort(rid)
            except Exception:  # the engine is already broken; the error above says so
                log.exception("abort of %s failed", rid)
        self._sinks.clear()

    def _snapshot(self) -> dict:
        e = self.engine
        sched = e.scheduler
        return {"name": "local-0", "role": "colocated", "address": "in-process",
                "block_size": e.config.block_size, **e.kv.usage(),
                "queue_depth": len(sched.waiting), "running": len(sched.running),
                "swapped": len(sched.swapped), "preemptions": sched.preemptions,
                "active_requests": len(e.requests), "steps": e.steps, "updated": time.time()}
