"""The Ray cluster behind the HTTP layer: `ClusterBackend`, the same contract as `LocalEngineBackend`.

It creates and holds the worker actors (Ray must already be initialised; see deploy.launch),
checks at start that every prefill worker can hand KV to every decode worker (the handshake
compares layouts and model identity; an incompatible pair refuses to start with the reason),
and drives them with typed commands (protocol.messages). Per request it picks a prefill and a
decode worker (Router), reserves room on the decode worker for the migration (credit-based
backpressure: a refusal is counted and the next decode worker asked; when all refuse, the
request waits in a FIFO line, only the first waiter being woken when a decode worker reports,
at most `reserve_wait_s`, then gets 503; beyond `max_waiting` waiters a new request gets 429 with
Retry-After at once), moves the ownership ledger (queued -> prefilling -> migrating -> decoding
-> finished/failed, an epoch per move) and submits the prompt.

Shape: the decisions are plain methods on one coordinator.state.ClusterState: routing,
admission, the ledger, reports and failover in coordinator.core's `ClusterCore`; the worker
table's changes (joins, replacements, drains, scales) in coordinator.membership. This class
is the driver that does the I/O: it feeds the core what happens (a request, a worker's answer, a
message off the report socket, a liveness check every `monitor_s`) and carries out the actions the
core returns (`_carry_out`). The workers' lifecycle is coordinator.lifecycle's `Fleet`; draining
and scaling, coordinator.drain's `Drainer`.

Colocated mode (`colocated = K`): K workers each running both phases, the baseline behind the same
API, ledger, routing and metrics. Per request, the policy in coordinator.decide (`disaggregate`)
may instead prefill on the decode worker itself (`local_prefill`: no prefill worker, no
reservation, no migration; the request's `prefill` and `decode` name the same worker); the
response's `pdserve.backend` says which path and why, and /metrics counts them. Every wait is
bounded.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections.abc import Callable

from coordinator.backend import FinalEvent
from coordinator.bounded import bounded
from coordinator.config import ClusterConfig
from coordinator.core import ClusterCore
from coordinator.drain import Drainer
from coordinator.errors import APIError, InternalError, InvalidRequest, ServiceUnavailable, Timeout
from coordinator.lifecycle import Fleet
from coordinator.membership import Membership
from coordinator.metrics import Metrics, worker_metrics_text
from coordinator.state import Action, ClusterState, Redispatch, Replace, ResendHeld, RetryPrefill, Tell
from coordinator.tasks import Tasks
from coordinator.workers import CommandEncodeError, RequestState, WorkerState, actor_died, command, tell
from protocol.messages import Reserve, WorkerReport
from protocol.prefix_hash import salt_key
from transfer.registry import validate as validate_transport

log = logging.getLogger(__name__)

__all__ = ["ClusterBackend", "ClusterConfig"]


class ClusterBackend:
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
        self.state = ClusterState.create(config, metrics or Metrics())
        self.core = ClusterCore(self.state)
        self.members = Membership(self.core)
        self.namespace = f"pdserve-{uuid.uuid4().hex[:8]}"
        self.progress = progress or _quiet  # also told by deploy.launch (binding the HTTP API)
        self.fleet = Fleet(self.members, self.namespace, self.progress)
        self.tasks = Tasks()
        self.drainer = Drainer(self.members, self.fleet, self.tasks, self._carry_out)
        self.name = config.name or config.model
        self.tokenizer = None  # loaded from the first worker's description at start
        self.max_context = self.vocab_size = 0
        self.weights = ""  # what the workers compute in (engine.weight_format.computed_in), known at start
        self._waiters: collections.deque[asyncio.Future] = collections.deque()  # waiting for decode room

    # ---- what the HTTP layer, the CLI and the tests read ----------------------------------------
    @property
    def config(self) -> ClusterConfig:
        return self.state.config

    @property
    def metrics(self) -> Metrics:
        return self.state.metrics

    @property
    def workers(self) -> dict[str, WorkerState]:
        return self.state.workers

    @property
    def ledger(self):
        return self.state.ledger

    @property
    def routers(self) -> dict:
        return self.state.routers

    @property
    def keys(self):
        return self.fleet.keys

    @property
    def _pull(self):
        """The report socket (tests plant reports on it)."""
        return self.fleet.reports

    # ---- the contract ---------------------------------------------------------------------------
    def model_names(self) -> list[str]:
        return [self.name]

    def health(self) -> tuple[bool, str]:
        s, now = self.state, time.monotonic()
        for role in s.roles:
            if not any(worker.alive(s.config.heartbeat_timeout_s, now) for worker in s.role(role)):
                empty = [f"{slot}: {why}" for slot, why in s.slot_status.items() if slot.startswith(role)]
                return False, f"no live {role} worker" + (f" ({'; '.join(empty)})" if empty else "")
        return True, "ok"

    def info(self) -> dict:
        s, now = self.state, time.monotonic()
        timeout = s.config.heartbeat_timeout_s
        workers = [{"name": worker.name, "role": worker.role, "address": worker.address,
                    "block_size": worker.block_size, "alive": worker.alive(timeout, now),
                    "not_alive_because": worker.why_not_alive(timeout, now), "loop": worker.progress,
                    **worker.info,
                    **{k: v for k, v in worker.stats.items() if k not in ("name", "role")}}
                   for worker in s.workers.values()]
        return {"mode": "colocated" if s.colocated else "cluster", "model": self.name,
                "transport": None if s.colocated else s.config.transport,
                "transport_capabilities": None if s.colocated else _capabilities(s.config.transport),
                "routing": s.config.routing, "workers": workers, "empty_slots": dict(s.slot_status),
                "ledger": s.ledger.summary()}

    def metrics_text(self) -> str:
        return worker_metrics_text([{**worker.stats, "name": worker.name, "role": worker.role}
                                    for worker in self.state.workers.values()])

    async def drain_worker(self, name: str, timeout_s: float | None = None) -> dict:
        """Drain one worker (coordinator.drain)."""
        return await self.drainer.drain_worker(name, timeout_s)

    async def scale(self, targets: dict, timeout_s: float | None = None) -> dict:
        """Bring roles to a number of workers (coordinator.drain)."""
        return await self.drainer.scale(targets, timeout_s)

    async def abort(self, request_id: str) -> None:
        request = self.state.requests.get(request_id)
        if request is not None:
            self._carry_out(self.core.fail(request, ServiceUnavailable("request aborted")))

    async def submit(self, creq):
        params = creq.sampling_params().with_seed()
        request = self.core.route(creq.request_id, creq.n, list(creq.prompt_ids), params, time.monotonic(),
                                  prefix_key=salt_key(creq.cache_salt))
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
            if request.rid in self.state.requests:
                self._carry_out(self.core.drop(request, ok=all(request.done)))

    # ---- starting and stopping ------------------------------------------------------------------
    async def start(self):
        from model_files.tokenizer import load_tokenizer

        c = self.config
        reports = self.fleet.open()
        self.tasks.spawn(self._read_reports(reports))
        try:
            infos = await self.fleet.start()
        except asyncio.TimeoutError:
            await self.aclose(graceful=False)
            raise RuntimeError(f"workers did not start within {c.start_timeout_s}s") from None
        except asyncio.CancelledError:  # stopped while starting (Ctrl-C): nothing was served yet
            await self.aclose(graceful=False)
            raise
        except Exception as e:
            await self.aclose(graceful=False)
            raise RuntimeError(f"a worker failed to start: {e}") from None
        first = infos[0]  # every worker serves the same model (the handshakes enforce it)
        self.max_context, self.vocab_size = first.max_context, first.vocab_size
        self.weights = "+".join(sorted({info.weights for info in infos}))  # one format unless configs differ
        self.tokenizer = load_tokenizer(None if c.model == "tiny" else c.model, first)
        self.tasks.spawn(self._monitor())
        return self

    async def aclose(self, graceful: bool = True) -> None:
        """Stop the workers: each is asked to shut down (bounded), then killed. graceful=False
        kills at once: a start that failed or was stopped, where a worker may still be inside
        its constructor (a shutdown call would wait for that) and holds no request."""
        await self.fleet.end_workers(graceful)
        await self.tasks.cancel_all()
        self.fleet.close_reports()
        for request in self.state.requests.values():
            request.q.put_nowait(ServiceUnavailable("server shutting down"))

    # ---- carrying out the core's decisions ------------------------------------------------------
    def _carry_out(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Tell):
                tell(action.worker, action.command)
            elif isinstance(action, (RetryPrefill, Redispatch)):  # the core picked its new workers
                self.tasks.spawn(self._redispatch(action.request))
            elif isinstance(action, ResendHeld):
                self.tasks.spawn(self._resend(action.request, action.bad, action.why))
            elif isinstance(action, Replace):
                self.tasks.spawn(self.fleet.replace(action.worker))
            else:
                raise TypeError(f"unknown action {action!r}")

    async def _read_reports(self, reports) -> None:
        """Every message off the report socket goes to the core, at the time it was read."""
        while True:
            message = await reports.get()
            try:
                self._carry_out(self.core.on_message(message, time.monotonic()))
                worker = self.state.workers.get(getattr(message, "worker", None))
                if isinstance(message, WorkerReport) and worker is not None and worker.role == "decode":
                    self._wake_first_waiter()  # its room may have changed: the first waiting request tries
            except Exception:  # a report that breaks a handler must not stop the reader
                log.exception("bad worker report from %s", getattr(message, "worker", "?"))
                self.metrics.count_error("bad_event")

    async def _monitor(self) -> None:
        """Every `monitor_s`, the core checks liveness and acts on the requests of a lost worker."""
        while True:
            await asyncio.sleep(self.config.monitor_s)
            self._carry_out(self.core.check_liveness(time.monotonic()))

    # ---- a request's I/O ------------------------------------------------------------------------
    async def _dispatch(self, request: RequestState) -> None:
        """Hand a request to its worker, after its decode worker reserved room for its migration
        when it needs one (coordinator.core: reservation_epoch, submit_command)."""
        epoch = self.core.reservation_epoch(request)
        if epoch is not None:
            await self._reserve(request, epoch)  # the ledger keeps the request queued while it waits
        worker, cmd = self.core.submit_command(request)
        c = self.config
        try:
            reply = await command(worker, cmd, c.call_timeout_s)
        except CommandEncodeError as e:  # this request's fields: a 400, the worker is fine
            raise InvalidRequest(f"the request cannot be encoded for the workers: {e}") from None
        except asyncio.TimeoutError:
            raise Timeout(f"a worker did not take the request within {c.call_timeout_s}s") from None
        except Exception as e:
            if actor_died(e):  # Ray says its process is gone: routing skips it from now on
                self.core.mark_dead(worker.name, type(e).__name__)
                raise ServiceUnavailable(f"worker {worker.name} died: {type(e).__name__}") from None
            # the call failed but the worker lives (its heartbeats say so): this request fails alone
            log.warning("request %s: worker %s could not take it: %r", request.rid, worker.name, e)
            self.metrics.count_error("dispatch")
            raise InternalError(f"worker {worker.name} could not take the request: {type(e).__name__}") \
                from None
        if reply.error:
            raise InvalidRequest(reply.error, param="prompt")

    async def _reserve(self, request: RequestState, epoch: int) -> None:
        """Credit-based backpressure: ask the decode workers the core lists, in its order, to admit
        the coming migration. When all refuse, wait in line (429 when `max_waiting` already wait)
        for a decode worker's report, up to reserve_wait_s, then 503."""
        c = self.config
        tokens = self.core.reservation_tokens(request)
        deadline = time.monotonic() + c.reserve_wait_s
        while request.rid in self.state.requests:  # until dropped (client gone, aborted)
            for worker in self.core.reserve_candidates(request, time.monotonic()):
                try:
                    reserve = Reserve(request.rid, epoch, tokens, request.n, request.prefill)
                    reply = await command(worker, reserve, c.call_timeout_s)
                except asyncio.TimeoutError:
                    raise Timeout(f"decode worker {worker.name} did not answer within {c.call_timeout_s}s") \
                        from None
                except CommandEncodeError as e:  # this request's fields, not the worker
                    raise InvalidRequest(f"the request cannot be encoded for the workers: {e}") from None
                except Exception as e:
                    if actor_died(e):  # Ray says it is gone: say so now, not a heartbeat later
                        self.core.mark_dead(worker.name, type(e).__name__)
                    log.warning("request %s: reserving on %s failed: %s: %s", request.rid, worker.name,
                                type(e).__name__, e)
                    continue  # either way, ask the next decode worker
                if reply.granted:
                    taken, actions = self.core.reserved(request, worker)
                    self._carry_out(actions)
                    if not taken:  # dropped while we waited: the credit went back
                        raise ServiceUnavailable("request aborted")
                    self._wake_first_waiter()  # room may be left for the next one in line
                    return
                self.core.refused(worker)
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServiceUnavailable(f"decode workers full: no room for the request within "
                                         f"{c.reserve_wait_s:g}s")
            await self._wait_in_line(min(left, 1.0))
        raise ServiceUnavailable("request aborted")

    async def _wait_in_line(self, timeout: float) -> None:
        """Wait for a decode worker's report (or `timeout`) behind the requests already waiting."""
        self.core.may_wait(len(self._waiters))
        turn = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        try:
            await bounded(turn, timeout)
        except asyncio.TimeoutError:  # no report woke it: look again anyway
            pass
        finally:
            if turn in self._waiters:
                self._waiters.remove(turn)

    def _wake_first_waiter(self) -> None:
        """A decode worker reported (or a reservation succeeded): the first waiter tries again."""
        while self._waiters:
            turn = self._waiters.popleft()
            if not turn.done():
                turn.set_result(None)
                return

    async def _redispatch(self, request: RequestState) -> None:
        try:
            await self._dispatch(request)
        except APIError as e:
            self._carry_out(self.core.fail_if_live(request, e))

    async def _resend(self, request: RequestState, bad: str, why: str) -> None:
        """The migration to decode worker `bad` failed and the prefill worker holds the blocks: reserve
        on another decode worker under a new epoch and have the prefill worker send them there."""
        epoch = self.core.begin_resend(request, bad)
        if epoch is None:
            return
        try:
            try:
                await self._reserve(request, epoch)  # switches request.decode (and frees the credit on `bad`)
            except APIError as e:  # the abort on the prefill worker gives the held blocks back
                self._carry_out(self.core.fail_if_live(request, ServiceUnavailable(
                    f"{why}; no other decode worker could take the held KV: {e.message}")))
                return
            worker, cmd = self.core.resend_command(request)
            try:
                error = (await command(worker, cmd, self.config.call_timeout_s)).error
            except Exception as e:  # the prefill worker died or stalled: the monitor reruns the prefill
                error = f"resend call failed: {type(e).__name__}"
            self._carry_out(self.core.resent(request, bad, why, error, time.monotonic()))
        finally:
            self.core.end_resend(request)


def _quiet(text: str) -> None:
    """The default progress: say nothing."""


def _capabilities(transport: str) -> dict:
    """What the cluster's transport can do (transfer.registry.Capabilities), for /v1/cluster."""
    import dataclasses

    from transfer.registry import get

    return dataclasses.asdict(get(transport).capabilities)
