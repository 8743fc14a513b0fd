"""The prefill role on the worker runtime: prefill, send first tokens, migrate, hold on failure.

After each engine step the handler hands every prefilled request to a migration thread
(`prefill_worker.migration_threads`), which migrates its live sequences to the decode worker the
coordinator named, under the epoch it gave (`transfer/`), while the engine keeps stepping; a
prompt still computing may stream its blocks already (`prefill_worker.streaming`, which shares
the handler's `Migrations`). The request's blocks stay allocated, owned by the handler
(`migrations.inflight`), until the result comes back
on the loop thread; then they are released (full ones stay in the prefix cache). A migration
that fails keeps the blocks: the request is *held* until the coordinator names another decode
worker with `Resend` (no re-prefill), and released on success, `Abort`, `DropHeld`, a newer
`Submit` of the request, or after `hold_s` without a resend (reported as
`RequestFailed(kind='hold_expired')`). An `Abort` of a request in flight frees its blocks when
its transfer returns.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from prefill_worker.migration_state import InFlightMigration, Migrations, Target
from prefill_worker.migration_threads import MigrationJob, MigrationResult, MigrationThreads
from prefill_worker.streaming import StreamedMigrations
from protocol.messages import Abort, Connect, DropHeld, Migrated, Reply, RequestFailed, Resend, Submit, Tokens
from runtime.actor import CALL, QUEUE, WorkerConfig, refuse_submit
from transfer.registry import get as get_transport
from transfer.registry import validate as validate_transport
from transfer.wire_messages import DecodeState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillWorkerConfig(WorkerConfig):
    transport: str = "zmq"           # how KV travels to decode workers: a name in transfer.registry
    # the transport's own options, by field name (its `transfer.registry` options dataclass: Ray's
    # namespace, ZeroMQ's receiver ports; coordinator.workers picks them for the cluster's transport)
    transport_options: dict = field(default_factory=dict)
    # bound on one migration's ack and on a handshake (waited for on a migration thread, not the loop)
    transfer_timeout_s: float = 30.0
    # how long a request whose migration failed keeps its blocks for a `Resend` (0: release at once)
    hold_s: float = 30.0
    # send a prompt's KV while it is still being computed: complete blocks leave after each prefill
    # chunk and the last ones with the first token (a streaming transport, CPU pools, one-choice requests;
    # anything else, or a stream that fails, migrates whole once the prefill is done)
    stream_migration: bool = True

    def __post_init__(self) -> None:
        get_transport(validate_transport(self.transport)).options_of(self.transport_options)


class PrefillHandler:
    def __init__(self, config: PrefillWorkerConfig, engine):
        from transfer.sender_sessions import SenderSessions

        self.config, self.engine = config, engine
        self.migrations = Migrations()
        self.held: dict[str, tuple[int, float]] = {}         # request id -> (failed epoch, deadline)
        keys = config.keys
        senders = SenderSessions(config.name, config.transport, engine.storage.layout.fingerprint(),
                             config.transport_options, config.transfer_timeout_s, keys.secret if keys else "",
                             pool=engine.storage)
        self.faults = senders.faults  # what InjectFault arms (the chaos benchmark)
        self._results: list[MigrationResult] = []  # results not posted to a loop (before `attach`)
        self._post_result = self._results.append  # where `_post` sends a result: the loop once attached
        self.migration_threads = MigrationThreads(senders, engine.kv, self._post,
                                                  gap_s=config.transfer_timeout_s)
        self.streaming = StreamedMigrations(engine, self.migration_threads, self.migrations)
        self.prefills = self.resends = self.hold_expired = self.stream_fallbacks = 0

    def attach(self, post) -> None:
        """The worker loop's `send`: a finished migration wakes the loop as a queued command."""
        self._post_result = post

    def _post(self, done: MigrationResult) -> None:
        """A migration thread's result (called on that thread)."""
        self._post_result(done)

    # ---- the calling thread -----------------------------------------------------------------------
    def accept(self, cmd):
        """Validate a Submit here (read-only); everything else runs on the loop."""
        if isinstance(cmd, Submit):
            refusal = refuse_submit(self.engine, cmd)
            if refusal is not None:
                return refusal
            if cmd.generated and cmd.params.n != 1:
                return Reply(error="only single-choice requests can resume after a decode worker is lost")
            return QUEUE
        if isinstance(cmd, (Abort, DropHeld)):
            return QUEUE
        if isinstance(cmd, Connect):  # the handshake runs on that decode worker's migration thread
            return Reply(error=self.migration_threads.connect(cmd.decode_worker, cmd.decode_address,
                                                    self.config.transfer_timeout_s) or "")
        if isinstance(cmd, Resend):
            return CALL
        return Reply(error=f"a prefill worker does not take {type(cmd).__name__}")

    # ---- the loop thread --------------------------------------------------------------------------
    def handle(self, cmd, events: list):
        if isinstance(cmd, Submit):
            self._submit(cmd, events)
        elif isinstance(cmd, Abort):
            self._release(cmd.request_id)
        elif isinstance(cmd, DropHeld):
            if self.held.get(cmd.request_id, (None,))[0] == cmd.epoch:
                self._release(cmd.request_id)
        elif isinstance(cmd, Resend):
            return self._resend(cmd)
        elif isinstance(cmd, MigrationResult):
            self._migration_done(cmd, events)
        return Reply()

    def _release(self, rid: str) -> None:
        self.migrations.targets.pop(rid, None)
        self.held.pop(rid, None)
        self.engine.abort(rid)
        if rid in self.migrations.inflight:
            self.migrations.inflight[rid].cancel()

    def _submit(self, cmd: Submit, events: list) -> None:
        rid = cmd.request_id
        self.held.pop(rid, None)
        if rid in self.engine.requests or rid in self.engine.prefilled:
            self.engine.abort(rid)  # an earlier attempt of the same request: this one supersedes it
        if rid in self.migrations.inflight:
            self.migrations.inflight[rid].cancel()
        try:
            self.engine.add_request(list(cmd.prompt_ids), cmd.params, request_id=rid,
                                    prefix_key=cmd.prefix_key)
        except Exception as e:  # validated already; a race with the pool
            events.append(RequestFailed(rid, cmd.epoch, "refused", str(e)))
            return
        self.prefills += 1
        if cmd.generated:  # not scheduled yet: the first prefill computes prompt + generated
            self.engine.requests[rid].seqs[0].output_ids = list(cmd.generated)
        request = self.engine.requests[rid]
        self.migrations.targets[rid] = Target(cmd.decode_worker, cmd.decode_address, cmd.epoch, request)

    def on_step(self, outputs, events: list) -> None:
        for o in outputs:
            target = self.migrations.targets.get(o.request_id)
            if target is None:
                continue
            req = target.request
            seq = next(s for s in req.seqs if s.index == o.index)
            events.append(Tokens(o.request_id, o.index, len(seq.output_ids) - len(o.new_token_ids),
                                 list(o.new_token_ids), (o.finish_reason or "stop") if o.finished else None,
                                 logprobs=[o.logprobs] if o.logprobs else [],
                                 cached_tokens=req.cached_tokens))
            if req.finished and o.request_id not in self.engine.prefilled:
                self.migrations.targets.pop(o.request_id, None)  # every choice ended at its first token

    def after_step(self, events: list) -> None:
        while self._results:  # finished before a loop was attached (a handler driven by hand)
            self._migration_done(self._results.pop(0), events)
        if self.config.stream_migration and self.engine.storage.device.type == "cpu":
            self.streaming.progress()
        for rid in list(self.engine.prefilled):
            flight = self.migrations.inflight.get(rid)
            if flight is None and rid not in self.held:
                self._start_migration(rid)
            elif flight is not None and flight.feed is not None \
                    and not (flight.finalized or flight.cancelled):
                self.streaming.finalize(rid, flight)
        self._expire_held(events)

    def _start_migration(self, rid: str) -> None:
        """Hand a prefilled request to its decode worker's migration thread; the blocks stay ours."""
        target = self.migrations.targets.pop(rid, None)
        req = self.engine.prefilled.pop(rid)
        if target is None:  # aborted meanwhile
            self.engine.free_request(req)
            return
        sampling = req.params.to_dict()
        seqs = [(s.seq_id, f"{rid}/{s.index}", DecodeState(list(s.token_ids), sampling, len(s.output_ids)))
                for s in req.live_seqs]
        self.migrations.inflight[rid] = InFlightMigration(req)
        job = MigrationJob(rid, target.decode_worker, target.decode_address, target.epoch, seqs)
        self.migration_threads.start(job)

    def _migration_done(self, done: MigrationResult, events: list) -> None:
        """A migration thread's result, on the loop thread: free the blocks, or hold them."""
        job = done.job
        flight = self.migrations.inflight.pop(job.rid)
        self.engine.kv.allocator.free_many(flight.pinned[::-1])
        if flight.feed is not None and not flight.finalized and not flight.cancelled:
            # the stream failed while the prompt was still computing: it migrates whole when done
            log.warning("%s: streamed migration of %s failed (%s); it migrates whole after its prefill",
                        self.config.name, job.rid, done.error)
            self.stream_fallbacks += 1
            return
        if flight.cancelled or done.error is None:
            if flight.request is not None:
                self.engine.free_request(flight.request)  # full blocks stay in the prefix cache
            if not flight.cancelled:
                events.append(Migrated(job.rid, job.decode_worker, job.epoch, done.milliseconds,
                                       transport=self.config.transport, phases=done.phases, **done.totals))
            return
        e = done.error
        log.warning("%s: migration of %s to %s failed: %s", self.config.name, job.rid, job.decode_worker, e)
        held = self.config.hold_s > 0
        if held:
            self.engine.prefilled[job.rid] = flight.request
            self.held[job.rid] = (job.epoch, time.monotonic() + self.config.hold_s)
        else:
            self.engine.free_request(flight.request)
        why = f"migration to {job.decode_worker} failed: {type(e).__name__}: {e}"
        events.append(RequestFailed(job.rid, job.epoch, "migration", why, held))

    def _resend(self, cmd: Resend) -> Reply:
        rid = cmd.request_id
        if self.held.pop(rid, None) is None or rid not in self.engine.prefilled:
            return Reply(error=f"request {rid} is not held on {self.config.name}")
        request = self.engine.prefilled[rid]
        self.migrations.targets[rid] = Target(cmd.decode_worker, cmd.decode_address, cmd.epoch, request)
        self.resends += 1
        return Reply()  # the loop migrates it after this iteration's step

    def _expire_held(self, events: list) -> None:
        now = time.monotonic()
        for rid, (epoch, deadline) in list(self.held.items()):
            if deadline <= now:
                del self.held[rid]
                self.engine.abort(rid)
                self.hold_expired += 1
                events.append(RequestFailed(rid, epoch, "hold_expired", f"no decode worker took the held KV "
                                            f"within {self.config.hold_s:g}s"))

    # ---- reports ----------------------------------------------------------------------------------
    def stats(self) -> dict:
        return {"held_requests": len(self.engine.prefilled) + len(self.migrations.inflight),
                "migrations_in_flight": len(self.migrations.inflight), "held_for_resend": len(self.held),
                "streamed_migrations": self.streaming.started, "stream_fallbacks": self.stream_fallbacks,
                "prefills": self.prefills, "resends": self.resends, "hold_expired": self.hold_expired,
                "prefix_hit_tokens": self.engine.kv.prefix_hit_tokens,
                "faults_injected": sum(self.faults.injected.values()),
                "corruptions_injected": self.faults.corruptions()}

    def holdings(self) -> dict[str, int]:
        from runtime.holdings import blocks_by_request

        flying = {rid: f.request for rid, f in self.migrations.inflight.items() if f.request is not None}
        return blocks_by_request(self.engine, {**flying, **self.engine.requests, **self.engine.prefilled})

    def close(self) -> None:
        # a stream waiting for blocks ends now, not at its timeout
        for flight in self.migrations.inflight.values():
            flight.cancel()
        self.migration_threads.close()
