"""Streamed migration on the prefill side: while a one-choice request's prompt is still being
prefilled, its complete blocks are pinned (referenced until the transfer returns) and fed to the
decode worker's migration thread (`prefill_worker.migration_threads`), and once the prompt is computed the
last blocks go with the first token's decode state. Each attempt (target) of a request streams
at most once: a stream that failed while the prompt was computing is not restarted, the request
migrates whole after its prefill. `PrefillHandler` owns one `StreamedMigrations` and calls it on
the loop thread.
"""

from __future__ import annotations

import queue

from prefill_worker.migration_state import InFlightMigration, Migrations, Target
from prefill_worker.migration_threads import MigrationJob, MigrationThreads
from transfer.wire_messages import DecodeState


class StreamedMigrations:
    """Starts, feeds and closes the streamed migrations of one prefill worker.

    engine: the worker's LLMEngine (its requests, computed blocks and allocator); migration_threads: the
    migration threads the streams run on; migrations: the targets and in-flight migrations shared
    with the handler.
    """

    def __init__(self, engine, migration_threads: MigrationThreads, migrations: Migrations):
        self.engine, self.migration_threads, self.migrations = engine, migration_threads, migrations
        self.tried: dict[str, Target] = {}  # request id -> the target it streamed to
        self.started = 0                    # streams started (the `streamed_migrations` stat)

    def progress(self) -> None:
        """Start or feed streamed migrations of one-choice requests still prefilling."""
        engine, targets, inflight = self.engine, self.migrations.targets, self.migrations.inflight
        for rid, flight in list(inflight.items()):  # ended at its first token, or gone
            if flight.feed is not None and not (flight.finalized or flight.cancelled) \
                    and rid not in engine.requests and rid not in engine.prefilled:
                flight.cancel()
        for rid in [rid for rid, target in self.tried.items() if targets.get(rid) is not target]:
            del self.tried[rid]  # that attempt ended (finalized, superseded, aborted)
        for rid, target in targets.items():
            req = engine.requests.get(rid)
            if req is None or req.params.n != 1 or req.is_beam or len(req.seqs) != 1:
                continue
            s = req.seqs[0]
            t = engine.kv.tables.get(s.seq_id)
            flight = inflight.get(rid)
            if t is None or t.swapped or s.output_ids or (flight is not None and flight.feed is None):
                continue
            done = engine.computed_blocks(rid)[0]  # blocks whose K/V is complete
            if flight is None:
                if not done or s.num_computed >= len(s.token_ids) or self.tried.get(rid) is target:
                    continue
                self.tried[rid] = target
                flight = inflight[rid] = InFlightMigration(None, feed=queue.SimpleQueue())
                self.migration_threads.start(MigrationJob(rid, target.decode_worker, target.decode_address,
                                                          target.epoch, [], flight.feed, list(s.token_ids),
                                                          req.params.to_dict()))
                self.started += 1
            if not (flight.finalized or flight.cancelled):
                new = self._pin(flight, done)
                if new:
                    flight.feed.put(new)

    def finalize(self, rid: str, flight: InFlightMigration) -> None:
        """The prompt is computed: the last blocks and the decode state close the stream."""
        req = flight.request = self.engine.prefilled.pop(rid)
        self.migrations.targets.pop(rid, None)
        s = req.seqs[0]
        blocks = self.engine.kv.table(s.seq_id).blocks[:-(-s.num_computed // self.engine.config.block_size)]
        last = self._pin(flight, blocks)  # the partial last block too
        flight.feed.put((last, DecodeState(list(s.token_ids), req.params.to_dict(), len(s.output_ids))))
        flight.finalized = True

    def _pin(self, flight: InFlightMigration, blocks: list[int]) -> list:
        """(logical, physical) pairs of `blocks` (physical, by logical index) not handed over yet,
        each referenced until the transfer returns."""
        new = list(enumerate(blocks))[flight.sent:]
        for _, b in new:
            self.engine.kv.allocator.incref(b)
        flight.pinned += [b for _, b in new]
        flight.sent = max(flight.sent, len(blocks))
        return new
