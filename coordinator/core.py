"""The coordinator's decisions, without I/O: `ClusterCore`.

Routing, admission to decode workers, the ownership ledger and its reconciliation, and failover,
as plain methods on one `ClusterState` (coordinator.state); the worker table's changes (joins,
replacements, drains, scales) are coordinator.membership's. Nothing here awaits, calls Ray, opens
a socket or reads a clock: the driver (coordinator.cluster.ClusterBackend) feeds it events (a
request arrived, a decode worker granted or refused room, a message off the report socket, a
liveness check at time `now`) and carries out the actions it returns (coordinator.state: Tell,
RetryPrefill, ResendHeld, Redispatch, Replace). A request's outputs (tokens, its final event, its
error) go to its own queue (`RequestState.q`). A test, or a simulator, drives it with hand-made
events.

Failure handling of the disaggregated cluster:
- a prefill worker lost before migrating: the request is rerun on another prefill worker;
- a migration to a decode worker failed while the prefill worker still holds the request's
  blocks: the driver reserves room on another decode worker under a new ledger epoch and asks the
  prefill worker to re-send the same blocks there (no re-prefill; counted as
  retries{phase="resend"} and in the request's `resent`). When no decode worker can take them
  within `reserve_wait_s`, the request fails with 503 and the prefill worker releases the blocks;
- a decode worker lost mid-decode (or a migration failure without held blocks): prefill again with
  prompt + the tokens streamed so far and continue on another decode worker (`resume`);
- a decode worker lost while a request has not migrated yet and its prefill worker is alive:
  nothing at once: the prefill worker's migration to it times out (its transfer timeout is below
  the heartbeat timeout) and reports held blocks, which are then re-sent;
- colocated workers: their requests fail with 503 at once.
Every lost worker is then replaced (Replace; coordinator.lifecycle).

Reports: every worker pushes one `WorkerReport` per loop iteration (stats, the blocks it holds per
request, typed events) and a `Heartbeat` every `report_s`. For each report the core applies the
events (by type), records the holdings in the ledger and reconciles (coordinator.reconcile):
orphaned blocks are aborted on the worker, a live request whose blocks vanished fails loudly.
Token events are reordered by output position (the first token comes from the prefill worker,
the rest from the decode worker, over different sockets).
"""

from __future__ import annotations

import logging

from coordinator.backend import FinalEvent
from coordinator.decide import DecideConfig, DecideInputs, Decision, decide
from coordinator.errors import APIError, InternalError, InvalidRequest, ServiceUnavailable
from coordinator.guard import Overloaded
from coordinator.ledger import Phase
from coordinator.router import NoWorkerError, WorkerLoad
from coordinator.state import Action, ClusterState, Redispatch, Replace, ResendHeld, RetryPrefill, Tell
from coordinator.workers import RequestState, WorkerState
from protocol.messages import (
    Abort,
    DropHeld,
    Heartbeat,
    Imported,
    ImportRefused,
    Migrated,
    RequestFailed,
    Resend,
    Submit,
    Tokens,
    WorkerReport,
)

log = logging.getLogger(__name__)


class ClusterCore:
    """Decides for the cluster; changes only `state` (see the module docstring)."""

    def __init__(self, state: ClusterState):
        self.state = state
        c = state.config
        self.decide_config = DecideConfig(c.disaggregate, c.local_prefill_max_tokens,
                                          c.local_prefill_max_waiting, c.prefill_ms_per_token)

    # ---- routing --------------------------------------------------------------------------------
    def loads(self, role: str, now: float) -> list[WorkerLoad]:
        """What the routers see of `role`: every worker but the draining ones."""
        s, out = self.state, []
        for worker in s.role(role):
            if worker.name in s.draining:  # draining: no new work for it
                continue
            free = int(worker.stats.get("free_blocks", 0)) + int(worker.stats.get("cached_blocks", 0))
            depth = int(worker.stats.get("queue_depth", 0))
            out.append(WorkerLoad(worker.name, free, depth, worker.block_size,
                                  worker.alive(s.config.heartbeat_timeout_s, now)))
        return out

    def route(self, rid: str, n: int, prompt: list[int], params: dict, now: float,
              prefix_key: str = "") -> RequestState:
        """A new request: pick its workers (and, disaggregated, where its prompt is prefilled: a
        local prefill names the decode worker as its prefill worker too), open it in the ledger.
        ServiceUnavailable when a role has no live worker."""
        s = self.state
        try:
            if s.colocated:
                loads = self.loads("colocated", now)
                prefill = decode = s.routers["colocated"].pick(loads, "colocated", prompt)
            else:
                prefill = s.routers["prefill"].pick(self.loads("prefill", now), "prefill", prompt)
                decode = s.routers["decode"].pick(self.loads("decode", now), "decode")
        except NoWorkerError as e:
            raise ServiceUnavailable(str(e)) from None
        if not s.colocated:
            decision = s.paths[rid] = self._decide(prompt, prefill, decode, now)
            if decision.path == "local_prefill":
                prefill = decode  # NOTE: prefill == decode is what marks the local path from here on
        request = RequestState(rid, n, len(prompt), prefill, decode, prompt, params, prefix_key=prefix_key)
        s.ledger.open(rid)
        s.requests[rid] = request
        return request

    def _decide(self, prompt: list[int], prefill: str, decode: str, now: float) -> Decision:
        """Where this prompt is prefilled (coordinator.decide), from the decode router's prefix memory,
        both workers' last reported queues and the migration times measured on this transport."""
        s = self.state
        load = next((w for w in self.loads("decode", now) if w.worker_id == decode), None)
        inputs = DecideInputs(len(prompt), s.routers["decode"].cached_tokens(load, prompt) if load else 0,
                              int(s.workers[prefill].stats.get("queue_depth", 0)),
                              int(s.workers[decode].stats.get("queue_depth", 0)),
                              s.metrics.migration_ms(s.config.transport),
                              int(s.workers[decode].stats.get("running", 0)),
                              s.workers[decode].info.get("startup", {}).get("prefill_ms_per_token"))
        decision = decide(inputs, self.decide_config)
        s.metrics.count_path(decision.path, decision.reason_kind)
        return decision

    def reservation_epoch(self, request: RequestState) -> int | None:
        """Before a dispatch: the epoch the decode worker must reserve room under (the MIGRATING
        move's, one more than the coming PREFILLING move's), or None when no reservation is needed
        (colocated, local prefill)."""
        if self.state.colocated or request.prefill == request.decode:
            return None
        request.epoch = self.state.ledger.get(request.rid).epoch + 2
        return request.epoch

    def submit_command(self, request: RequestState) -> tuple[WorkerState, Submit]:
        """The dispatch itself (after any reservation): the ledger moves, and the Submit to send to
        the returned worker."""
        s = self.state
        if s.colocated:
            s.ledger.move(request.rid, Phase.DECODING, request.decode)
            return s.workers[request.decode], Submit(request.rid, request.prompt, request.params,
                                                     prefix_key=request.prefix_key)
        if request.prefill == request.decode:  # local prefill: the decode worker runs both phases
            request.epoch = s.ledger.move(request.rid, Phase.DECODING, request.decode)
            self._remember_decode(request)
            return s.workers[request.decode], Submit(request.rid, request.prompt, request.params,
                                                     epoch=request.epoch, prefix_key=request.prefix_key)
        s.ledger.move(request.rid, Phase.PREFILLING, request.prefill)
        decode = s.workers[request.decode]
        self._remember_decode(request)
        return s.workers[request.prefill], Submit(request.rid, request.prompt, request.params, decode.name,
                                                  decode.address, request.epoch, list(request.generated),
                                                  prefix_key=request.prefix_key)

    def _remember_decode(self, request: RequestState) -> None:
        """Either path leaves the prompt's full blocks in the decode worker's prefix cache (imports are
        sealed like local prefills): the decode router remembers them for the next decisions."""
        worker = self.state.workers[request.decode]
        self.state.routers["decode"].remember(worker.name, request.prompt, worker.block_size or 16)

    def mark_dead(self, name: str, why: str) -> None:
        """Ray said the worker's process is gone: routing skips it from now on."""
        worker = self.state.workers.get(name)
        if worker is not None:
            worker.dead = why

    # ---- admission to decode workers ------------------------------------------------------------
    def reservation_tokens(self, request: RequestState) -> int:
        return len(request.prompt) + len(request.generated) + 1

    def reserve_candidates(self, request: RequestState, now: float) -> list[WorkerState]:
        """The decode workers to ask for room, in order: request.decode first, then the others by
        free blocks. ServiceUnavailable when none is live; InvalidRequest when the request fits
        no decode worker's pool."""
        s, tokens = self.state, self.reservation_tokens(request)
        loads = sorted((w for w in self.loads("decode", now)
                        if w.alive and w.worker_id not in s.lost | request.avoid),
                       key=lambda w: (w.worker_id != request.decode, -w.free_blocks))
        if not loads:
            raise ServiceUnavailable("no live decode worker")
        if all(request.n * (-(-tokens // w.block_size) + 1) > s.workers[w.worker_id].stats.get(
                "total_blocks", 1 << 30) for w in loads):
            raise InvalidRequest(f"{request.n} x {tokens} tokens (+1 block each) exceed every decode "
                                 "worker's KV pool", param="prompt")
        return [s.workers[w.worker_id] for w in loads]

    def reserved(self, request: RequestState, worker: WorkerState) -> tuple[bool, list[Action]]:
        """`worker` granted the request room: it decodes there (an earlier attempt's credit elsewhere
        is given back). False when the request was dropped meanwhile: the credit is given back."""
        if request.rid not in self.state.requests:
            return False, [Tell(worker, Abort(request.rid))]
        old, request.decode = self.state.workers.get(request.decode), worker.name
        if old is not None and old.name != request.decode:
            return True, [Tell(old, Abort(request.rid))]
        return True, []

    def refused(self, worker: WorkerState) -> None:
        self.state.metrics.count_backpressure(worker.name)

    def may_wait(self, waiting: int) -> None:
        """Overloaded (429) when `waiting` requests already wait for decode room."""
        if waiting >= self.state.config.max_waiting:
            raise Overloaded(f"{waiting} requests already wait for decode room: retry shortly")

    # ---- a request ends ---------------------------------------------------------------------------
    def drop(self, request: RequestState, ok: bool) -> list[Action]:
        """Forget a request; abort it on both workers unless it finished there."""
        s = self.state
        s.requests.pop(request.rid, None)
        s.paths.pop(request.rid, None)
        s.ledger.close(request.rid, ok)
        # in a fixed order (not a set's, which varies with the process's string hashing): the
        # simulation replays a run from its seed in any process
        names = dict.fromkeys((request.prefill, request.decode) if not ok else (request.decode,))
        return [Tell(s.workers[name], Abort(request.rid)) for name in names if name in s.workers]

    def fail(self, request: RequestState, error: APIError) -> list[Action]:
        """Drop the request and hand `error` to its caller."""
        actions = self.drop(request, ok=False)
        request.q.put_nowait(error)
        return actions

    def fail_if_live(self, request: RequestState, error: APIError) -> list[Action]:
        return self.fail(request, error) if request.rid in self.state.requests else []

    def path_info(self, request: RequestState) -> dict:
        """The response's path fields (`pdserve.backend`): where the prompt was prefilled, and why."""
        decision = self.state.paths.get(request.rid)
        if decision is None:
            return {}
        local = request.prefill == request.decode
        return {"path": decision.to_dict(), **({"decode_worker": request.decode} if local else {})}

    # ---- reports ----------------------------------------------------------------------------------
    def on_message(self, message, now: float) -> list[Action]:
        """One message off the report socket: a WorkerReport or a Heartbeat (else counted as bad)."""
        s = self.state
        if isinstance(message, WorkerReport):
            return self.on_report(message, now)
        if isinstance(message, Heartbeat):
            worker = s.workers.get(message.worker) or s.joining.get(message.worker)
            if worker is not None:
                worker.beat(message, now)
        else:
            s.metrics.count_error("bad_event")
        return []

    def on_report(self, report: WorkerReport, now: float) -> list[Action]:
        s = self.state
        worker = s.workers.get(report.worker)
        if worker is None:
            joining = s.joining.get(report.worker)  # a replacement still handshaking: stats only
            if joining is not None:
                joining.stats, joining.last_seen = dict(report.stats), now
            return []
        worker.stats, worker.holdings = dict(report.stats), dict(report.holdings)
        worker.last_seen = now
        actions: list[Action] = []
        for event in report.events:
            actions += self._on_event(worker, event, now)
        s.ledger.record(worker.name, worker.holdings)
        assigned = {rid: {r.prefill, r.decode} for rid, r in s.requests.items()}
        generated = frozenset(rid for rid, r in s.requests.items() if all(r.done))
        orphans, vanished = s.reconciler.check(worker.name, worker.role, worker.stats, worker.holdings,
                                               assigned, generated, now=now)
        actions += [Tell(worker, Abort(rid)) for rid in orphans]
        for rid in vanished:
            request = s.requests.get(rid)
            if request is not None:
                actions += self.fail(request, InternalError(f"the KV blocks of the request vanished on "
                                                            f"{worker.name}"))
        return actions

    def _on_event(self, worker: WorkerState, event, now: float) -> list[Action]:
        s = self.state
        request = s.requests.get(event.request_id)
        epoch = getattr(event, "epoch", None)
        stale = request is None or worker.name not in (request.prefill, request.decode) \
            or (epoch is not None and epoch != request.epoch and not s.colocated)
        if stale:  # finished, aborted, or from an earlier attempt of this request
            if isinstance(event, RequestFailed) and event.held:  # held for a resend nobody will ask for
                return [Tell(worker, DropHeld(event.request_id, event.epoch))]
            return []
        if isinstance(event, Tokens):
            if worker.name == request.decode:
                self._advance(request, Phase.DECODING)
            if request.cached_tokens is None and event.cached_tokens is not None:
                request.cached_tokens = event.cached_tokens  # the first prefill's (not a resume's)
            request.place(event.index, event.start, list(event.token_ids), event.finish_reason,
                          event.logprobs)
        elif isinstance(event, Migrated):
            self._advance(request, Phase.MIGRATING)
            request.migration = {"ms": event.milliseconds, "bytes": event.payload_bytes,
                                 "blocks": event.blocks, "reused": event.reused_blocks,
                                 "seqs": event.sequences, "transport": event.transport,
                                 "to": event.decode_worker, "phases": dict(event.phases)}
            s.metrics.observe_migration(event.milliseconds, event.payload_bytes, event.blocks,
                                        event.transport, event.phases)
        elif isinstance(event, Imported):
            self._advance(request, Phase.DECODING)
        elif isinstance(event, ImportRefused):
            s.metrics.count_error("stale_epoch")
        elif isinstance(event, RequestFailed):
            return self._failed(worker, request, event, now)
        return self._maybe_finish(request)

    def _failed(self, worker: WorkerState, request: RequestState, event: RequestFailed,
                now: float) -> list[Action]:
        s = self.state
        if event.kind == "migration":
            s.metrics.count_error("migration")
            if request.decoded:  # the decode worker imported it: only its answer to the sender was lost
                return self._migrated_anyway(request, event.message, event)
            if event.held:  # the prefill worker still holds the blocks: send them elsewhere
                return [ResendHeld(request, request.decode, event.message)]
            return self.resume(request, request.decode, event.message, now)
        s.metrics.count_error(event.kind)
        error = InvalidRequest if event.kind == "refused" else \
            ServiceUnavailable if event.kind == "hold_expired" else InternalError
        return self.fail(request, error(f"{worker.name}: {event.message}"))

    def _migrated_anyway(self, request: RequestState, why: str,
                         event: RequestFailed | None = None) -> list[Action]:
        """The decode worker imported the request (Imported or its tokens came under this epoch),
        but its `Migrated` will never come: the sender's migration failed on its side (the
        receiver's ack was lost or late: `event`, whose held blocks are dropped) or the prefill
        worker was lost. The request goes on where it is, and finishes with its last token; it
        is not moved or failed (found by the simulation: `dst`)."""
        request.migration = {"to": request.decode, "sender_error": why}
        actions: list[Action] = []
        if event is not None and event.held:
            actions.append(Tell(self.state.workers[request.prefill], DropHeld(request.rid, event.epoch)))
        return actions + self._maybe_finish(request)

    def _advance(self, request: RequestState, phase: Phase) -> None:
        """Move the ledger forward to `phase`, through MIGRATING when events arrive out of order."""
        ledger = self.state.ledger
        entry = ledger.get(request.rid)
        order = [Phase.PREFILLING, Phase.MIGRATING, Phase.DECODING]
        if entry is None or entry.phase not in order or order.index(entry.phase) >= order.index(phase):
            return
        for step in order[order.index(entry.phase) + 1:order.index(phase) + 1]:
            ledger.move(request.rid, step, request.decode)
        request.decoded = request.decoded or phase is Phase.DECODING

    def _maybe_finish(self, request: RequestState) -> list[Action]:
        if request.finished or not all(request.done) or (request.decoded and request.migration is None):
            return []
        request.finished = True
        info = {"prefill_worker": request.prefill,
                "decode_worker": request.decode if request.decoded else None,
                "migration": request.migration, "resumed": request.resumed, "resent": request.resent,
                **self.path_info(request)}  # where the prompt was prefilled, and why (coordinator.decide)
        if self.state.colocated:
            info = {"worker": request.decode, "role": "colocated"}
        actions = self.drop(request, ok=True)
        request.q.put_nowait(FinalEvent(request.prompt_tokens, info, request.cached_tokens or 0))
        return actions

    # ---- failover ---------------------------------------------------------------------------------
    def check_liveness(self, now: float) -> list[Action]:
        """Act, at once, on the requests of every worker found not alive at `now` (see the module
        docstring), and have it replaced; a lost worker that is alive again is lost no more."""
        s, actions = self.state, []
        for worker in list(s.workers.values()):
            why = worker.why_not_alive(s.config.heartbeat_timeout_s, now)
            if why is None:
                s.lost.discard(worker.name)
                continue
            if worker.name in s.lost:
                continue
            s.lost.add(worker.name)
            s.ledger.forget_worker(worker.name)  # a dead worker holds nothing
            s.reconciler.forget_worker(worker.name)
            log.warning("worker %s is gone: %s", worker.name, why)
            s.routers[worker.role].forget(worker.name)
            for request in list(s.requests.values()):
                actions += self._on_lost(worker, request, now)
            actions.append(Replace(worker))
        return actions

    def _on_lost(self, worker: WorkerState, request: RequestState, now: float) -> list[Action]:
        s = self.state
        if request.rid not in s.requests:  # ended by an earlier decision of this check
            return []
        if worker.role == "colocated":
            if request.decode == worker.name:
                s.metrics.count_error("worker_lost")
                return self.fail(request, ServiceUnavailable(f"colocated worker {worker.name} stopped "
                                                             "responding; the request was lost"))
            return []
        unmigrated = request.migration is None and not request.decoded
        if request.prefill == worker.name and request.migration is None and request.decoded:
            return self._migrated_anyway(request, f"prefill worker {worker.name} was lost before it "
                                                  "reported the migration")
        on_prefill = request.prefill == worker.name and unmigrated
        if on_prefill and request.decode not in s.lost:
            return self.retry_prefill(request, worker.name, now)
        if request.decode == worker.name and not all(request.done):
            if request.resending or (unmigrated and request.prefill not in s.lost):
                return []  # the prefill worker's migration to it fails and its held blocks are re-sent
            return self.resume(request, worker.name, f"decode worker {worker.name} stopped responding", now)
        if on_prefill:
            s.metrics.count_error("worker_lost")
            return self.fail(request, ServiceUnavailable(f"{worker.role} worker {worker.name} stopped "
                                                         "responding; the request was lost"))
        return []

    def retry_prefill(self, request: RequestState, lost: str, now: float) -> list[Action]:
        """The prefill worker `lost` died before migrating: rerun the prompt on another one (a new
        epoch at its dispatch). Tokens it already sent are not repeated: events are placed by
        output position. No other prefill worker: the request fails with 503."""
        try:
            request.prefill = self.state.routers["prefill"].pick(self.loads("prefill", now), "prefill",
                                                                 request.prompt, exclude={lost})
        except NoWorkerError:
            return self.fail(request, ServiceUnavailable(f"prefill worker {lost} stopped responding and "
                                                         "no other is live"))
        self.state.metrics.count_retry("prefill")
        log.warning("request %s: prefill worker %s lost, rerunning on %s", request.rid, lost, request.prefill)
        return [RetryPrefill(request, lost)]

    def resume(self, request: RequestState, bad: str, why: str, now: float) -> list[Action]:
        """The decode worker `bad` died or a migration to it failed: prefill again (n=1: prompt +
        the tokens streamed so far, sampling continuing at their count; n>1: from the start) and
        continue on another decode worker. Positions already sent are never sent twice (the
        reorder drops them). Workers are picked now, so a second trigger sees the new owner."""
        s = self.state
        try:  # NOTE: picked into locals: a failure below still names `bad`, so its credit goes back
            decode = s.routers["decode"].pick(self.loads("decode", now), "decode", exclude=s.lost | {bad})
            generated = list(request.tokens[0]) if request.n == 1 else []
            prefill = s.routers["prefill"].pick(self.loads("prefill", now), "prefill",
                                                request.prompt + generated, exclude=s.lost)
        except NoWorkerError:
            return self.fail(request, ServiceUnavailable(f"{why}; no other live decode/prefill worker to "
                                                         "continue on"))
        request.decode, request.generated, request.prefill = decode, generated, prefill
        request.avoid.add(bad)
        old = s.workers.get(bad)
        actions: list[Action] = [Tell(old, Abort(request.rid))] if old is not None else []  # its credit
        request.resumed += 1
        request.migration, request.decoded = None, False
        s.metrics.count_retry("decode")
        log.warning("request %s: %s; resuming after %d tokens via %s -> %s", request.rid, why,
                    len(request.generated), request.prefill, request.decode)
        return actions + [Redispatch(request)]

    def begin_resend(self, request: RequestState, bad: str) -> int | None:
        """A resend starts: the prefill worker keeps owning the blocks, so a new ownership epoch,
        the migration's after it (returned: the epoch to reserve under). None: the request was
        dropped meanwhile (its abort released the held blocks)."""
        if request.rid not in self.state.requests:
            return None
        request.resending = True
        request.avoid.add(bad)
        request.epoch = self.state.ledger.move(request.rid, Phase.PREFILLING, request.prefill) + 1
        return request.epoch

    def resend_command(self, request: RequestState) -> tuple[WorkerState, Resend]:
        d, s = self.state.workers[request.decode], self.state
        return s.workers[request.prefill], Resend(request.rid, d.name, d.address, request.epoch)

    def resent(self, request: RequestState, bad: str, why: str, error: str | None,
               now: float) -> list[Action]:
        """The prefill worker answered the resend (`error`: why it could not, e.g. the blocks are
        no longer held: prefill again instead)."""
        if request.rid not in self.state.requests:
            return []
        request.resumed += 1
        request.resending = False
        if error:
            log.warning("request %s: %s; re-prefilling", request.rid, error)
            return self.resume(request, bad, f"{why}; {error}", now)
        request.resent += 1
        self.state.metrics.count_retry("resend")
        log.warning("request %s: %s; re-sending the held KV from %s to %s", request.rid, why,
                    request.prefill, request.decode)
        return []

    def end_resend(self, request: RequestState) -> None:
        request.resending = False
