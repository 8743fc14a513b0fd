"""What the HTTP layer needs from whatever runs the model, and the in-process implementation.

The contract is duck-typed (no base class; a second implementation, the Ray cluster, plugs in
with the same methods and attributes):

    tokenizer                     encode(text) -> list[int], decode(ids) -> str
    max_context: int              prompt + max_tokens may not exceed it
    vocab_size: int               prompt ids must be below it
    async def submit(creq)        an async iterator of events for one CompletionRequest (its
                                  prompt_ids filled): TokenEvent(index, token_ids,
                                  finish_reason, logprobs) per choice and batch, finish_reason
                                  set on each choice's last one, then one
                                  FinalEvent(prompt_tokens, info, cached_tokens). It raises
                                  protocol.APIError subclasses (InvalidRequest,
                                  ServiceUnavailable("no live prefill worker"), ...), before
                                  the first event where it can. Closing the iterator early
                                  (client gone, stop string found upstream) must abort the
                                  request and free its blocks everywhere.
    async def abort(request_id)   abort a request by id (idempotent)
    def model_names() -> list[str]    served names; the first is the default
    def info() -> dict            the /v1/cluster body (workers, ledger, ...)
    def health() -> (bool, str)   liveness and a one-line reason
    def metrics_text() -> str     extra Prometheus text (e.g. metrics.worker_metrics_text)

`LocalEngineBackend` runs one colocated engine in process on the worker runtime (the same loop
and `ColocatedHandler` as a colocated Ray worker, decode_worker.colocated): requests and aborts
are typed commands on its queue, and each report's `Tokens` events go back to the waiting
coroutines' asyncio queues with `loop.call_soon_threadsafe`. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from coordinator.bounded import bounded
from coordinator.metrics import worker_metrics_text
from coordinator.protocol import APIError, InvalidRequest, ServiceUnavailable, Timeout
from protocol.messages import Abort, Reply, RequestFailed, Submit
from protocol.prefix_hash import salt_key

log = logging.getLogger(__name__)
WORKER = "local-0"  # the in-process engine's worker name (metrics labels, /v1/cluster)


@dataclass(frozen=True)
class TokenEvent:
    """New tokens of choice `index`; finish_reason ('stop', 'length') on its last event."""

    index: int
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    logprobs: tuple = ()  # protocol.messages.TokenLogprobs per token, when the request asked


@dataclass(frozen=True)
class FinalEvent:
    """The request is done on the backend. info: backend facts for the client (worker,
    preemptions, migration...), JSON-safe. cached_tokens: prompt tokens the prefix cache gave."""

    prompt_tokens: int
    info: dict
    cached_tokens: int = 0


@dataclass(frozen=True)
class LocalBackendConfig:
    name: str | None = None        # the model name served (None: the engine's model spec, e.g. 'tiny')
    event_timeout_s: float = 120.0  # bound on the wait for a request's next step output
    idle_poll_s: float = 0.05      # how long the idle engine thread waits for commands at a time
    close_timeout_s: float = 10.0  # bound on joining the engine thread at close()


class _Sink:
    """Where one request's outputs go: an asyncio queue on the submitting coroutine's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, n: int, prompt_tokens: int):
        self.loop, self.q = loop, asyncio.Queue()
        self.remaining, self.prompt_tokens, self.preemptions = n, prompt_tokens, 0
        self.cached_tokens: int | None = None

    def put(self, item) -> bool:
        try:
            self.loop.call_soon_threadsafe(self.q.put_nowait, item)
            return True
        except RuntimeError:  # the loop is closed: nobody listens any more
            return False


class LocalEngineBackend:
    """One in-process colocated engine behind the backend contract (see module docstring)."""

    def __init__(self, engine_config=None, *, engine=None, config: LocalBackendConfig = LocalBackendConfig()):
        from decode_worker.colocated import ColocatedHandler
        from engine.engine import EngineConfig, LLMEngine
        from runtime.actor import WorkerConfig

        self.config = config
        self.engine = engine if engine is not None else LLMEngine(engine_config or EngineConfig())
        self.name = config.name or self.engine.config.model
        self.tokenizer = self.engine.tokenizer
        self.max_context = self.engine.model_config.max_position_embeddings
        self.vocab_size = self.engine.model_config.vocab_size
        self.aborted = 0
        self.handler = ColocatedHandler(WorkerConfig(WORKER, ""), self.engine)
        self._sinks: dict[str, _Sink] = {}
        self._stats: dict = {"name": WORKER, "role": "colocated", **self.engine.kv.usage(),
                             "active_requests": 0}
        self._loop = None

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> LocalEngineBackend:
        from runtime.loop import LoopConfig, WorkerLoop

        c = self.config
        config = LoopConfig(WORKER, idle_poll_s=c.idle_poll_s, call_timeout_s=c.close_timeout_s)
        self._loop = WorkerLoop(config, self.handler, self._emit)
        return self

    def close(self) -> None:
        if self._loop is not None:
            self._loop.shutdown()
        self._fail_all(ServiceUnavailable("server shutting down"))

    def __enter__(self) -> LocalEngineBackend:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the contract ---------------------------------------------------------------------
    def model_names(self) -> list[str]:
        return [self.name]

    def health(self) -> tuple[bool, str]:
        if self._loop is None or not self._loop.alive():
            failed = self._loop.failed if self._loop is not None else None
            return False, f"engine failed: {failed}" if failed else "engine thread is not running"
        return True, "ok"

    def info(self) -> dict:
        s = {**self._stats, "address": "in-process"}
        return {"mode": "local", "model": self.name, "workers": [s],
                "ledger": {"active_requests": s["active_requests"], "owned_blocks": s["used_blocks"]},
                "aborted_requests": self.aborted}

    def metrics_text(self) -> str:
        return worker_metrics_text([self._stats])

    async def abort(self, request_id: str) -> None:
        if self._sinks.pop(request_id, None) is not None:
            self.aborted += 1
        if self._loop is not None:
            self._loop.send(Abort(request_id))

    async def submit(self, creq):
        ok, why = self.health()
        if not ok:
            raise ServiceUnavailable(why)
        cmd = Submit(creq.request_id, list(creq.prompt_ids), creq.sampling_params(),
                     prefix_key=salt_key(creq.cache_salt))
        verdict = self.handler.accept(cmd)  # validates the prompt against the engine (read-only)
        if isinstance(verdict, Reply):
            raise InvalidRequest(verdict.error, param="prompt")
        rid = cmd.request_id
        sink = self._sinks[rid] = _Sink(asyncio.get_running_loop(), creq.n, len(creq.prompt_ids))
        self._loop.send(cmd)
        done = False
        try:
            while True:
                try:
                    batch = await bounded(sink.q.get(), self.config.event_timeout_s)
                except asyncio.TimeoutError:
                    raise Timeout(f"no engine output for {self.config.event_timeout_s}s") from None
                if isinstance(batch, APIError):
                    done = True
                    raise batch
                for event in batch:
                    done = done or isinstance(event, FinalEvent)
                    yield event
                if done:
                    return
        finally:
            if not done:
                await self.abort(rid)

    # ---- the engine thread ----------------------------------------------------------------
    def _emit(self, events: list, stats: dict, holdings: dict) -> None:
        """The loop's report: route each request's events to its sink (one put per request)."""
        self._stats = stats
        batches: dict[str, list] = {}
        for event in events:
            sink = self._sinks.get(event.request_id)
            if sink is None:
                continue
            if isinstance(event, RequestFailed):
                self._sinks.pop(event.request_id, None)
                sink.put(InvalidRequest(event.message, param="prompt"))
                continue
            batch = batches.setdefault(event.request_id, [])
            batch.append(TokenEvent(event.index, tuple(event.token_ids), event.finish_reason,
                                    tuple(event.logprobs)))
            if sink.cached_tokens is None and event.cached_tokens is not None:
                sink.cached_tokens = event.cached_tokens
            if event.finish_reason is not None:
                sink.remaining -= 1
                sink.preemptions = max(sink.preemptions, event.preemptions)
        for rid, batch in batches.items():
            sink = self._sinks.get(rid)
            if sink is not None and sink.remaining <= 0:
                del self._sinks[rid]
                info = {"worker": WORKER, "preemptions": sink.preemptions}
                batch.append(FinalEvent(sink.prompt_tokens, info, sink.cached_tokens or 0))
            if sink is not None and not sink.put(batch):
                self._sinks.pop(rid, None)
                self._loop.send(Abort(rid))

    def _fail_all(self, err: APIError) -> None:
        for rid in list(self._sinks):
            sink = self._sinks.pop(rid, None)
            if sink is not None:
                sink.put(err)
