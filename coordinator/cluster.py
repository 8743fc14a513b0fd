"""The Ray cluster behind the HTTP layer: `ClusterBackend`, the same contract as `LocalEngineBackend`.

It creates and holds the worker actors (Ray must already be initialised; see deploy.launch),
checks at start that every prefill worker can hand KV to every decode worker (the handshake
compares layouts and model identity; an incompatible pair refuses to start with the reason),
and drives them with typed commands (protocol.messages). Per request it picks a prefill and a
decode worker (Router), reserves room on the decode worker for the migration (credit-based
backpressure: a refusal is counted and the next decode worker asked; when all refuse the
request waits, at most `reserve_wait_s`, then gets 503), moves the ownership ledger (queued ->
prefilling -> migrating -> decoding -> finished/failed, an epoch per move) and submits the
prompt. Worker reports, token reordering and ledger reconciliation: coordinator.reports;
failures: coordinator.failover. Colocated mode (`colocated = K`): K workers each running both
phases, the baseline behind the same API, ledger, routing and metrics. Per request, the policy in
coordinator.decide (`disaggregate`) may instead prefill on the decode worker itself
(`local_prefill`: no prefill worker, no reservation, no migration; the request's `prefill` and
`decode` name the same worker); the response's `pdserve.backend` says which path and why, and
/metrics counts them. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import uuid
from collections.abc import Callable

from coordinator.admission import AdmissionMixin
from coordinator.bounded import bounded
from coordinator.completion_request import (
    APIError,
    InternalError,
    InvalidRequest,
    ServiceUnavailable,
    Timeout,
)
from coordinator.config import ClusterConfig
from coordinator.decide import DecideConfig, DecideInputs, Decision, decide
from coordinator.failover import FailoverMixin
from coordinator.ledger import Ledger, Phase
from coordinator.lifecycle import LifecycleMixin
from coordinator.metrics import Metrics, worker_metrics_text
from coordinator.reconcile import Reconciler
from coordinator.reports import ReportsMixin
from coordinator.router import NoWorkerError, Router, WorkerLoad
from coordinator.workers import (
    ROLES_COLOCATED,
    ROLES_DISAGGREGATED,
    CommandEncodeError,
    RequestState,
    actor_died,
    command,
    tell,
)
from protocol.messages import Abort, Submit
from protocol.prefix_hash import salt_key
from transfer.registry import validate as validate_transport

log = logging.getLogger(__name__)


class ClusterBackend(LifecycleMixin, AdmissionMixin, FailoverMixin, ReportsMixin):
    """Prefill + decode actors behind the backend contract (see coordinator.backend)."""

    def __init__(self, config: ClusterConfig | None = None, metrics: Metrics | None = None,
                 progress: Callable[[str], None] | None = None):
        """progress: told one line per phase of `start` (workers starting, handshakes), e.g. to print."""
        config = config or ClusterConfig()
        validate_transport(config.transport)  # ValueError naming the registered transports
        if config.colocated < 0:
            raise ValueError(f"colocated must be >= 0, got {config.colocated}")
        if not config.colocated and (config.prefill < 1 or config.decode < 1):
            raise ValueError("a cluster needs at least one prefill and one decode worker")
        self.colocated = config.colocated > 0
        self.roles = ROLES_COLOCATED if self.colocated else ROLES_DISAGGREGATED
        self.config, self.metrics = config, metrics or Metrics()
        self.progress = progress or _quiet
        self.decide_config = DecideConfig(config.disaggregate, config.local_prefill_max_tokens,
                                          config.local_prefill_max_waiting, config.prefill_ms_per_token)
        self._paths: dict[str, Decision] = {}        # request id -> where its prompt is prefilled, and why
        self.tokenizer = None  # loaded from the first worker's description at start
        self.max_context = self.vocab_size = 0
        self.weights = ""  # what the workers compute in (engine.weight_format.computed_in), known at start
        self.name = config.name or config.model
        self.namespace = f"pdserve-{uuid.uuid4().hex[:8]}"
        self.ledger = Ledger()
        self.reconciler = Reconciler(self.ledger, config.ledger_grace_s, self.metrics.count_discrepancy)
        self.routers = {role: Router(config.routing) for role in self.roles}  # one cycle per role
        self.workers: dict = {}
        self._requests: dict[str, RequestState] = {}
        self._lost: set[str] = set()
        self._replacing: set[str] = set()  # lost workers whose replacement is on the way
        self._restarts: dict[str, list[float]] = {}  # slot -> times of its recent replacements
        self.slot_status: dict[str, str] = {}        # slot -> why it is empty now (being replaced)
        self._joining: dict = {}                     # replacement workers not yet handshaken
        self.draining: dict[str, float] = {}         # workers being drained -> since (coordinator.drain)
        self._retired: set[str] = set()              # slots drained away: never replaced nor reused
        self._scaling = False                        # a scale is under way (coordinator.drain)
        self._waiters: collections.deque = collections.deque()  # requests waiting for decode room, in order
        self.bind_host = "127.0.0.1"                 # where the report socket binds (set at start)
        self._published: dict = {}                   # model path -> its copy in the object store
        self.keys = None                             # the cluster's protocol.curve.ClusterKeys (start)
        self._tasks: set[asyncio.Task] = set()
        self._reader = self._monitor_task = self._pull = None

    # ---- the contract ---------------------------------------------------------------------------
    def model_names(self) -> list[str]:
        return [self.name]

    def _role(self, role: str) -> list:
        return [worker for worker in self.workers.values() if worker.role == role]

    def _loads(self, role: str) -> list[WorkerLoad]:
        timeout, out = self.config.heartbeat_timeout_s, []
        for worker in self._role(role):
            if worker.name in self.draining:  # coordinator.drain: no new work for it
                continue
            free = int(worker.stats.get("free_blocks", 0)) + int(worker.stats.get("cached_blocks", 0))
            depth = int(worker.stats.get("queue_depth", 0))
            out.append(WorkerLoad(worker.name, free, depth, worker.block_size, worker.alive(timeout)))
        return out

    def health(self) -> tuple[bool, str]:
        for role in self.roles:
            if not any(worker.alive(self.config.heartbeat_timeout_s) for worker in self._role(role)):
                empty = [f"{slot}: {why}" for slot, why in self.slot_status.items() if slot.startswith(role)]
                return False, f"no live {role} worker" + (f" ({'; '.join(empty)})" if empty else "")
        return True, "ok"

    def info(self) -> dict:
        timeout = self.config.heartbeat_timeout_s
        workers = [{"name": worker.name, "role": worker.role, "address": worker.address,
                    "block_size": worker.block_size, "alive": worker.alive(timeout),
                    "not_alive_because": worker.why_not_alive(timeout), "loop": worker.progress,
                    **worker.info,
                    **{k: v for k, v in worker.stats.items() if k not in ("name", "role")}}
                   for worker in self.workers.values()]
        return {"mode": "colocated" if self.colocated else "cluster", "model": self.name,
                "transport": None if self.colocated else self.config.transport,
                "transport_capabilities": None if self.colocated else _capabilities(self.config.transport),
                "routing": self.config.routing, "workers": workers, "empty_slots": dict(self.slot_status),
                "ledger": self.ledger.summary()}

    def metrics_text(self) -> str:
        return worker_metrics_text([{**worker.stats, "name": worker.name, "role": worker.role}
                                    for worker in self.workers.values()])

    async def abort(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is not None:
            self._drop(request, ok=False)
            request.q.put_nowait(ServiceUnavailable("request aborted"))

    async def submit(self, creq):
        from coordinator.backend import FinalEvent

        params = creq.sampling_params().with_seed()
        prompt = list(creq.prompt_ids)
        try:
            if self.colocated:
                loads = self._loads("colocated")
                prefill = decode = self.routers["colocated"].pick(loads, "colocated", prompt)
            else:
                prefill = self.routers["prefill"].pick(self._loads("prefill"), "prefill", prompt)
                decode = self.routers["decode"].pick(self._loads("decode"), "decode")
        except NoWorkerError as e:
            raise ServiceUnavailable(str(e)) from None
        rid = creq.request_id
        if not self.colocated:
            decision = self._paths[rid] = self._decide(prompt, prefill, decode)
            if decision.path == "local_prefill":
                prefill = decode  # NOTE: prefill == decode is what marks the local path from here on
        request = RequestState(rid, creq.n, len(prompt), prefill, decode, prompt, params,
                               prefix_key=salt_key(creq.cache_salt))
        self.ledger.open(rid)
        self._requests[rid] = request
        try:
            await self._dispatch(request)
            while True:
                try:
                    event = await bounded(request.q.get(), self.config.event_timeout_s)
                except asyncio.TimeoutError:
                    raise Timeout(f"no worker output for {self.config.event_timeout_s}s") from None
                if isinstance(event, APIError):
                    raise event
                yield event
                if isinstance(event, FinalEvent):
                    return
        finally:
            if rid in self._requests:
                self._drop(request, ok=all(request.done))

    async def _dispatch(self, request: RequestState) -> None:
        """Hand a request to its prefill worker, after its decode worker reserved room for its
        migration under the MIGRATING move's epoch (one more than this PREFILLING move's; may
        switch request.decode, or wait). Colocated: the one worker does it all."""
        if self.colocated:
            self.ledger.move(request.rid, Phase.DECODING, request.decode)
            target = request.decode
            cmd = Submit(request.rid, request.prompt, request.params, prefix_key=request.prefix_key)
        elif request.prefill == request.decode:  # local prefill: the decode worker runs both phases
            request.epoch = self.ledger.move(request.rid, Phase.DECODING, request.decode)
            target = request.decode
            cmd = Submit(request.rid, request.prompt, request.params, epoch=request.epoch,
                         prefix_key=request.prefix_key)
            self._remember_decode(request)
        else:
            epoch = request.epoch = self.ledger.get(request.rid).epoch + 2
            await self._reserve(request, epoch)  # the ledger keeps the request queued while it waits
            self.ledger.move(request.rid, Phase.PREFILLING, request.prefill)
            decode = self.workers[request.decode]
            target = request.prefill
            cmd = Submit(request.rid, request.prompt, request.params, decode.name, decode.address, epoch,
                         list(request.generated), prefix_key=request.prefix_key)
            self._remember_decode(request)
        try:
            reply = await command(self.workers[target], cmd, self.config.call_timeout_s)
        except CommandEncodeError as e:  # this request's fields: a 400, the worker is fine
            raise InvalidRequest(f"the request cannot be encoded for the workers: {e}") from None
        except asyncio.TimeoutError:
            raise Timeout(f"a worker did not take the request within {self.config.call_timeout_s}s") from None
        except Exception as e:
            if actor_died(e):  # Ray says its process is gone: routing skips it from now on
                self.workers[target].dead = type(e).__name__
                raise ServiceUnavailable(f"worker {target} died: {type(e).__name__}") from None
            # the call failed but the worker lives (its heartbeats say so): this request fails alone
            log.warning("request %s: worker %s could not take it: %r", request.rid, target, e)
            self.metrics.count_error("dispatch")
            raise InternalError(f"worker {target} could not take the request: {type(e).__name__}") from None
        if reply.error:
            raise InvalidRequest(reply.error, param="prompt")

    def _decide(self, prompt: list[int], prefill: str, decode: str) -> Decision:
        """Where this prompt is prefilled (coordinator.decide), from the decode router's prefix memory,
        both workers' last reported queues and the migration times measured on this transport."""
        load = next((w for w in self._loads("decode") if w.worker_id == decode), None)
        inputs = DecideInputs(len(prompt), self.routers["decode"].cached_tokens(load, prompt) if load else 0,
                              int(self.workers[prefill].stats.get("queue_depth", 0)),
                              int(self.workers[decode].stats.get("queue_depth", 0)),
                              self.metrics.migration_ms(self.config.transport),
                              int(self.workers[decode].stats.get("running", 0)),
                              self.workers[decode].info.get("startup", {}).get("prefill_ms_per_token"))
        decision = decide(inputs, self.decide_config)
        self.metrics.count_path(decision.path, decision.reason_kind)
        return decision

    def _remember_decode(self, request: RequestState) -> None:
        """Either path leaves the prompt's full blocks in the decode worker's prefix cache (imports are
        sealed like local prefills): the decode router remembers them for the next decisions."""
        worker = self.workers[request.decode]
        self.routers["decode"].remember(worker.name, request.prompt, worker.block_size or 16)

    def _path_info(self, request: RequestState) -> dict:
        """The response's path fields (`pdserve.backend`): where the prompt was prefilled, and why."""
        decision = self._paths.get(request.rid)
        if decision is None:
            return {}
        local = request.prefill == request.decode
        return {"path": decision.to_dict(), **({"decode_worker": request.decode} if local else {})}

    def _drop(self, request: RequestState, ok: bool) -> None:
        """Forget a request; abort it on both workers unless it finished there."""
        self._requests.pop(request.rid, None)
        self._paths.pop(request.rid, None)
        self.ledger.close(request.rid, ok)
        for name in {request.prefill, request.decode} if not ok else (request.decode,):
            worker = self.workers.get(name)
            if worker is not None:
                tell(worker, Abort(request.rid))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _quiet(text: str) -> None:
    """The default progress: say nothing."""


def _capabilities(transport: str) -> dict:
    """What the cluster's transport can do (transfer.registry.Capabilities), for /v1/cluster."""
    import dataclasses

    from transfer.registry import get

    return dataclasses.asdict(get(transport).capabilities)
