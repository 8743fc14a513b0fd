"""Transfer threads of a prefill worker: migrations run here, never on the engine loop.

The loop thread hands a prefilled request to `start` and keeps stepping; the request's tables stay
allocated (the handler owns them) until the result comes back, so the thread reads stable pool
memory without taking references of its own (exports are built with `lease=False`: no allocator
call happens off the loop thread). There is one thread per decode worker, each with its own
sender (`transfer.sender_sessions.SenderSessions`), so a dead or slow decode worker delays only the
migrations queued for it; after one times out, the jobs already queued for that worker fail at
once instead of each waiting out its own timeout. Each finished job is handed back as a
`MigrationResult` through `post` (the worker loop's command queue), where the handler frees the blocks,
reports `Migrated`, or holds the request for a resend. `connect` runs a handshake on the target's
thread and waits for it. Tests pause streamed migrations mid-flight with `hold_streams` (each
stops after its first blocks went out, until `release_streams`), so a worker can be killed while
a stream is open.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from transfer.errors import TransferError, TransferTimeout

if TYPE_CHECKING:
    from transfer.sender_sessions import SenderSessions

log = logging.getLogger(__name__)
HOLD_MAX_S = 60.0  # the longest a held stream waits for `release_streams`


@dataclass
class MigrationJob:
    """Migrate these sequences of request `rid` to `decode_worker` under `epoch`."""

    rid: str
    decode_worker: str
    decode_address: str
    epoch: int
    seqs: list  # (seq_id, transfer id "rid/index", DecodeState)
    # a streamed migration (one sequence, offered while its prompt is computed): the loop thread
    # puts lists of (logical, physical) complete blocks, then the final DecodeState (None: cancel)
    feed: queue.SimpleQueue | None = None
    token_ids: list = field(default_factory=list)  # the tokens being computed
    sampling: dict = field(default_factory=dict)


@dataclass
class MigrationResult:
    """A finished MigrationJob: `error` is None when every sequence was acknowledged."""

    job: MigrationJob
    error: Exception | None
    milliseconds: float
    totals: dict = field(default_factory=dict)
    phases: dict = field(default_factory=dict)


class MigrationThreads:
    def __init__(self, senders: SenderSessions, manager, post, gap_s: float = 30.0):
        self.senders, self.manager, self.post = senders, manager, post
        self.gap_s = gap_s  # longest wait for a streamed migration's next blocks
        self._queues: dict[str, queue.SimpleQueue] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._gate: threading.Event | None = None  # set by hold_streams (tests)
        self.held_streams: set[str] = set()        # request ids of streams waiting at the gate

    def _queue(self, name: str) -> queue.SimpleQueue:
        with self._lock:
            q = self._queues.get(name)
            if q is None:
                q = self._queues[name] = queue.SimpleQueue()
                t = threading.Thread(target=self._run, args=(name, q), name=f"migrate-{name}", daemon=True)
                t.start()
                self._threads.append(t)
            return q

    # ---- the loop thread ---------------------------------------------------------------------
    def start(self, job: MigrationJob) -> None:
        self._queue(job.decode_worker).put(job)

    def connect(self, name: str, address: str, timeout: float) -> str | None:
        """Handshake with a decode worker on its thread; an error message, or None when compatible."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue(name).put((future, address))
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            return f"TransferTimeout: no handshake with {name} within {timeout:g}s"

    def hold_streams(self) -> None:
        """Tests: from now on a streamed migration stops after its first blocks went out (the decode
        worker holds an open stream) until `release_streams`, `close` or HOLD_MAX_S."""
        with self._lock:
            self._gate = self._gate or threading.Event()

    def holding(self) -> list[str]:
        """Request ids of the streams waiting at the gate now (held_streams, read under the lock)."""
        with self._lock:
            return sorted(self.held_streams)

    def release_streams(self) -> None:
        with self._lock:
            gate, self._gate = self._gate, None
        if gate is not None:
            gate.set()

    def close(self) -> None:
        self.release_streams()
        with self._lock:
            queues, threads = list(self._queues.values()), list(self._threads)
        for q in queues:
            q.put(None)
        for t in threads:
            t.join(5)
        self.senders.close()

    # ---- the migration threads ---------------------------------------------------------------------
    def _run(self, name: str, q: queue.SimpleQueue) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            if isinstance(item, tuple):  # a handshake request
                future, address = item
                try:
                    future.set_result(self.senders.connect(name, address))
                except Exception as e:  # a socket error beyond TransferError: this thread serves on
                    log.exception("migration thread %s: handshake failed", name)
                    future.set_result(f"{type(e).__name__}: {e}")
                continue
            try:
                done = self._migrate(item)
            except Exception as e:  # never lose a job: the handler must get its blocks back
                log.exception("migration thread %s failed", name)
                error = RuntimeError(f"migration thread failed: {type(e).__name__}: {e}")
                done = MigrationResult(item, error, 0.0)
            self.post(done)
            if isinstance(done.error, TransferTimeout):
                self._fail_queued(name, q)

    def _fail_queued(self, name: str, q: queue.SimpleQueue) -> None:
        """The decode worker just timed out: what is queued for it fails now (held for a resend)."""
        while True:
            try:
                item = q.get_nowait()
            except queue.Empty:
                return
            if item is None:
                q.put(None)
                return
            why = f"{name} timed out on a migration moments ago"
            if isinstance(item, tuple):
                item[0].set_result(f"TransferTimeout: {why}")
            else:
                self.post(MigrationResult(item, TransferTimeout(why), 0.0))

    def _stream(self, job: MigrationJob) -> MigrationResult:
        """A streamed migration: milliseconds is the part after the prefill finished (exposed)."""
        def items():
            for n in itertools.count():
                if n == 1:
                    self._hold(job.rid)
                try:
                    item = job.feed.get(timeout=self.gap_s)
                except queue.Empty:
                    raise TransferTimeout(f"no prefill progress for {self.gap_s:g}s") from None
                if item is None:
                    return
                yield item

        try:
            sender = self.senders.get(job.decode_worker, job.decode_address)
            ack = sender.migrate_streamed(self.manager, f"{job.rid}/0", job.epoch, job.token_ids,
                                          job.sampling, items())
        except (TransferError, OSError, RuntimeError, ValueError) as e:
            self.senders.forget_if_broken(job.decode_worker, e)
            return MigrationResult(job, e, 0.0)
        totals = {"payload_bytes": ack.nbytes, "blocks": ack.new_blocks, "reused_blocks": ack.reused_blocks,
                  "sequences": 1}
        phases = dict(sender.last_phases)
        return MigrationResult(job, None, phases.get("exposed_ms", 0.0), totals, phases)

    def _hold(self, rid: str) -> None:
        """Wait at the test gate, if one is up (see hold_streams)."""
        with self._lock:
            gate = self._gate
            if gate is None:
                return
            self.held_streams.add(rid)
        try:
            gate.wait(HOLD_MAX_S)
        finally:
            with self._lock:
                self.held_streams.discard(rid)

    def _migrate(self, job: MigrationJob) -> MigrationResult:
        if job.feed is not None:
            return self._stream(job)
        started = time.perf_counter()
        totals = {"payload_bytes": 0, "blocks": 0, "reused_blocks": 0, "sequences": 0}
        phases: dict[str, float] = {}
        try:
            sender = self.senders.get(job.decode_worker, job.decode_address)
            for seq_id, transfer_id, state in job.seqs:
                ack = sender.migrate(self.manager, seq_id, transfer_id, job.epoch, state, lease=False)
                for k, v in sender.last_phases.items():
                    phases[k] = phases.get(k, 0.0) + v
                totals["payload_bytes"] += ack.nbytes
                totals["blocks"] += ack.new_blocks
                totals["reused_blocks"] += ack.reused_blocks
                totals["sequences"] += 1
        except (TransferError, OSError, RuntimeError, ValueError) as e:
            self.senders.forget_if_broken(job.decode_worker, e)
            return MigrationResult(job, e, (time.perf_counter() - started) * 1e3)
        return MigrationResult(job, None, (time.perf_counter() - started) * 1e3, totals, phases)
