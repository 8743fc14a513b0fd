"""Worker reports, as a mixin of `ClusterBackend` (coordinator.cluster).

Every worker pushes one `WorkerReport` per loop iteration (at least every `report_s`) to the
coordinator's `PullQueue`, and its heartbeat thread a `Heartbeat` every `report_s` (liveness and
loop progress: coordinator.workers.WorkerState.wedged). A report carries its stats, the blocks
it holds per request, and typed events. For
each report the coordinator applies the events (dispatched by type), then records the holdings
in the ledger and reconciles (coordinator.reconcile): orphaned blocks are aborted on the worker,
a live request whose blocks vanished is failed loudly. Token events are reordered by output
position (the first token comes from the prefill worker, the rest from the decode worker, over
different sockets).
"""

from __future__ import annotations

import logging
import time

from coordinator.completion_request import InternalError, InvalidRequest, ServiceUnavailable
from coordinator.ledger import Phase
from coordinator.workers import tell
from protocol.messages import (
    Abort,
    DropHeld,
    Heartbeat,
    Imported,
    ImportRefused,
    Migrated,
    RequestFailed,
    Tokens,
    WorkerReport,
)

log = logging.getLogger(__name__)


class ReportsMixin:
    """Needs from the host class: config, workers, ledger, reconciler, metrics, _requests, _joining, _pull,
    _wake_first_waiter, _path_info,
    _drop, _spawn, _resend, _resume (see coordinator.cluster and coordinator.failover)."""

    async def _read_reports(self) -> None:
        while True:
            report = await self._pull.get()
            try:
                if isinstance(report, WorkerReport):
                    self._on_report(report)
                elif isinstance(report, Heartbeat):
                    worker = self.workers.get(report.worker) or self._joining.get(report.worker)
                    if worker is not None:
                        worker.beat(report)
                else:
                    self.metrics.count_error("bad_event")
            except Exception:  # a report that breaks a handler must not stop the reader
                log.exception("bad worker report from %s", getattr(report, "worker", "?"))
                self.metrics.count_error("bad_event")

    def _on_report(self, report: WorkerReport) -> None:
        worker = self.workers.get(report.worker)
        if worker is None:
            joining = self._joining.get(report.worker)  # a replacement still handshaking: stats only
            if joining is not None:
                joining.stats, joining.last_seen = dict(report.stats), time.monotonic()
            return
        worker.stats, worker.holdings = dict(report.stats), dict(report.holdings)
        worker.last_seen = time.monotonic()
        for event in report.events:
            self._on_event(worker, event)
        self.ledger.record(worker.name, worker.holdings)
        if worker.role == "decode":
            self._wake_first_waiter()  # its room may have changed: the first waiting request tries
        assigned = {rid: {r.prefill, r.decode} for rid, r in self._requests.items()}
        generated = frozenset(rid for rid, r in self._requests.items() if all(r.done))
        orphans, vanished = self.reconciler.check(worker.name, worker.role, worker.stats, worker.holdings,
                                                  assigned, generated)
        for rid in orphans:
            tell(worker, Abort(rid))
        for rid in vanished:
            request = self._requests.get(rid)
            if request is not None:
                self._drop(request, ok=False)
                request.q.put_nowait(InternalError(f"the KV blocks of the request vanished on {worker.name}"))

    def _on_event(self, worker, event) -> None:
        request = self._requests.get(event.request_id)
        epoch = getattr(event, "epoch", None)
        stale = request is None or worker.name not in (request.prefill, request.decode) \
            or (epoch is not None and epoch != request.epoch and not self.colocated)
        if stale:  # finished, aborted, or from an earlier attempt of this request
            if isinstance(event, RequestFailed) and event.held:  # held for a resend nobody will ask for
                tell(worker, DropHeld(event.request_id, event.epoch))
            return
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
            self.metrics.observe_migration(event.milliseconds, event.payload_bytes, event.blocks,
                                           event.transport, event.phases)
        elif isinstance(event, Imported):
            self._advance(request, Phase.DECODING)
        elif isinstance(event, ImportRefused):
            self.metrics.count_error("stale_epoch")
        elif isinstance(event, RequestFailed):
            self._failed(worker, request, event)
            return
        self._maybe_finish(request)

    def _failed(self, worker, request, event: RequestFailed) -> None:
        if event.kind == "migration":
            self.metrics.count_error("migration")
            if event.held:  # the prefill worker still holds the blocks: send them elsewhere
                self._spawn(self._resend(request, request.decode, event.message))
            else:
                self._resume(request, request.decode, event.message)
            return
        self.metrics.count_error(event.kind)
        self._drop(request, ok=False)
        error = InvalidRequest if event.kind == "refused" else \
            ServiceUnavailable if event.kind == "hold_expired" else InternalError
        request.q.put_nowait(error(f"{worker.name}: {event.message}"))

    def _advance(self, request, phase: Phase) -> None:
        """Move the ledger forward to `phase`, through MIGRATING when events arrive out of order."""
        entry = self.ledger.get(request.rid)
        order = [Phase.PREFILLING, Phase.MIGRATING, Phase.DECODING]
        if entry is None or entry.phase not in order or order.index(entry.phase) >= order.index(phase):
            return
        for step in order[order.index(entry.phase) + 1:order.index(phase) + 1]:
            self.ledger.move(request.rid, step, request.decode)
        request.decoded = request.decoded or phase is Phase.DECODING

    def _maybe_finish(self, request) -> None:
        from coordinator.backend import FinalEvent

        if request.finished or not all(request.done) or (request.decoded and request.migration is None):
            return
        request.finished = True
        info = {"prefill_worker": request.prefill,
                "decode_worker": request.decode if request.decoded else None,
                "migration": request.migration, "resumed": request.resumed, "resent": request.resent,
                **self._path_info(request)}  # where the prompt was prefilled, and why (coordinator.decide)
        if self.colocated:
            info = {"worker": request.decode, "role": "colocated"}
        self._drop(request, ok=True)
        request.q.put_nowait(FinalEvent(request.prompt_tokens, info, request.cached_tokens or 0))
