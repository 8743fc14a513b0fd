"""`LocalEngineBackend`: one colocated engine in process behind the backend contract
(coordinator.backend), the server of `pdserve serve`. It runs on the worker runtime, with the same
loop and `ColocatedHandler` as a colocated Ray worker (colocated_worker.worker): requests and
aborts are typed commands on its queue, and each report's `Tokens` events go back to the waiting
coroutines' asyncio queues with `loop.call_soon_threadsafe`. Every wait is bounded. It sits above
the coordinator because it loads the engine, which the coordinator never does.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from coordinator.backend import FinalEvent, TokenEvent
from coordinator.bounded import bounded
from coordinator.completion_request import APIError, InvalidRequest, ServiceUnavailable, Timeout
from coordinator.metrics import worker_metrics_text
from protocol.messages import Abort, Reply, RequestFailed, Submit
from protocol.prefix_hash import salt_key

WORKER = "local-0"  # the in-process engine's worker name (metrics labels, /v1/cluster)


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
        from colocated_worker.worker import ColocatedHandler
        from engine.engine import EngineConfig, LLMEngine
        from runtime.actor import WorkerConfig

        self.config = config
        self.engine = engine if engine is not None else LLMEngine(engine_config or EngineConfig())
        self.name = config.name or self.engine.config.model
        self.tokenizer = self.engine.tokenizer
        self.max_context = self.engine.model_config.max_position_embeddings
        self.vocab_size = self.engine.model_config.vocab_size
        self.weights = self.engine.computes_in
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
