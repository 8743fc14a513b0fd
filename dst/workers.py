"""Simulated prefill and decode workers: the real pools and the real protocol, no engine.

They speak production's commands and events (`protocol.messages`): a worker's events go to the
coordinator inside a `WorkerReport` with its holdings, sent at once, and periodically without
events, as real workers report.

A prefill worker takes a `Submit` (prompt + the tokens already generated, on a resume), writes
the fake model's K/V for it into its pool (`dst.model`), and migrates it with the real sender
steps (`SenderSession.migrate_steps`) driven by `dst.channel.Task`, one migration at a time per
decode worker; it reports `Migrated`, or `RequestFailed(kind="migration", held=True)` and keeps
the blocks for a `Resend` to another decode worker, until `DropHeld`, `Abort` or `hold_s` passes
(then `RequestFailed(kind="hold_expired")`), as `prefill_worker.handler` does. Exports it could
not hand over stay leased until their virtual lease expires. A decode worker admits only
transfers its coordinator reserved (request, epoch, sender), serves them with the real receiver
(`SimReceiver`), checks every committed sequence's bytes against the fake model, then decodes
the fake model's tokens and reports them (`Imported`, then `Tokens` at their output position).
`crash` restarts a worker: its memory is lost, its pool kept (the bytes stay, the allocator is
new) or wiped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dst.channel import Later, SimAdvert, SimChannel, SimReceiver, SimSource, Task
from dst.model import LAYOUT, kv_matches, make_manager, next_token, write_kv
from dst.net import COORDINATOR
from kvcache import BlockAllocator, KVCacheManager
from protocol.messages import (
    Abort,
    DropHeld,
    Imported,
    Migrated,
    RequestFailed,
    Resend,
    Submit,
    Tokens,
    WorkerReport,
)
from transfer.epochs import EpochGuard
from transfer.errors import TransferError
from transfer.metrics import TransferMetrics
from transfer.session import SenderSession
from transfer.wire_messages import DecodeState

MIN_QUIET_REPORTS = 4  # reports a quiet worker still sends (the reconciler counts MIN_REPORTS of them)


class Violation(AssertionError):
    """An invariant broke: what, where, and when (virtual seconds)."""


@dataclass
class SimConfig:
    """The simulated cluster's shape and bounds (virtual seconds)."""

    prefills: int = 1
    decodes: int = 1
    blocks: int = 24
    report_s: float = 0.05
    reports: bool = True  # periodic holdings reports (the exhaustive explorer runs without them)
    prefill_s: float = 0.002
    decode_step_s: float = 0.02
    request_timeout_s: float = 3.0
    hold_s: float = 0.6  # a prefill worker keeps a failed migration's blocks this long for a Resend
    # above the longest a delayed report can be late (dst.net), so a slow link is never a death
    heartbeat_timeout_s: float = 2.5
    monitor_s: float = 0.1


class Leases:
    """The exports of one worker not yet released, each with its virtual lease deadline."""

    def __init__(self, net, owner, lease_s: float):
        self.net, self.owner, self.lease_s, self.items = net, owner, lease_s, []

    def add(self, export) -> None:
        self.items.append(export)
        incarnation = self.owner.incarnation

        def expire():
            if self.owner.incarnation == incarnation:
                export.release()
        self.net.timer(self.owner.name, self.net.now + self.lease_s, expire)

    def extra_refs(self) -> dict[int, int]:
        out: dict[int, int] = {}
        self.items = [e for e in self.items if not e.released]
        for e in self.items:
            for b, n in e.extra_refs().items():
                out[b] = out.get(b, 0) + n
        return out


@dataclass
class Job:
    rid: str
    epoch: int
    seq: str
    decode: str
    state: DecodeState | None = None
    task: Task | None = None
    started: bool = False
    held: bool = False  # its migration failed: the blocks wait for a Resend
    feed: StreamFeed | None = None  # a streamed migration's prefill (the first attempt only)


class StreamFeed:
    """The prefill of a job migrated while it is computed (`SenderSession.migrate_streamed_steps`):
    one chunk of `CHUNK_TOKENS` every `prefill_s`, each item the blocks that chunk completed and
    the last one with the DecodeState. Each item is a `Later`: the steps wait for the chunk."""

    CHUNK_TOKENS = 3  # not a block's 4: chunks end inside blocks, and some complete none

    def __init__(self, worker: PrefillWorker, job: Job, computed: int):
        self.worker, self.job = worker, job
        self.done, self.sent, self.ended = computed, 0, False  # tokens computed, blocks handed over

    def __iter__(self):
        return self

    def __next__(self) -> Later:
        if self.ended:
            raise StopIteration
        return Later(self._park)

    def _park(self, task: Task) -> None:
        w, job = self.worker, self.job

        def chunk():
            if not task.finished and w.jobs.get(job.rid) is job:  # else dropped, or the task gave up
                task.resume(self.compute(), None)
        w.net.timer(w.name, w.net.now + w.cfg.prefill_s, chunk)

    def compute(self):
        """Compute the next chunk; its item (the blocks it completed; the last one with the state)."""
        manager, seq, n = self.worker.manager, self.job.seq, len(self.job.state.token_ids) - 1
        end = min(n, self.done + self.CHUNK_TOKENS)
        write_kv(manager, seq, self.done, end)
        self.done = end
        table, B = manager.table(seq), LAYOUT.block_size
        full = end // B if end < n else -(-n // B)
        blocks = [(i, table.blocks[i]) for i in range(self.sent, full)]
        self.sent = full
        if end < n:
            return blocks
        manager.mark_computed(seq, n)
        self.ended = True
        return blocks, self.job.state


class Worker:
    role = ""

    def __init__(self, net, name: str, cfg: SimConfig, tcfg):
        self.net, self.name, self.cfg, self.tcfg = net, name, cfg, tcfg
        self.incarnation = 0
        self.manager = make_manager(cfg.blocks)
        self.ever: set[str] = set()  # requests this worker was ever given (any incarnation)
        self.lost: set[str] = set()  # requests a crash took from it
        net.nodes[name] = self
        self.boot()

    def boot(self) -> None:
        self.reporting, self.quiet_reports = self.cfg.reports, 0
        if self.reporting:
            self.net.timer(self.name, self.net.now, self._report_loop, readonly=True)

    def crash(self, wipe: bool) -> None:
        """Restart: memory lost; the pool's bytes kept (a new allocator over them) or wiped."""
        self.lost |= set(self.holdings())
        self.incarnation += 1
        storage = make_manager(self.cfg.blocks).storage if wipe else self.manager.storage
        self.manager = KVCacheManager(BlockAllocator(self.cfg.blocks), LAYOUT.block_size, storage)
        self.boot()

    def report(self, *events) -> None:
        """A WorkerReport to the coordinator: the stats and holdings now, and `events`."""
        a = self.manager.allocator
        stats = {"used_blocks": a.num_used, "free_blocks": a.num_free, "total_blocks": self.cfg.blocks,
                 "queue_depth": 0}
        self.net.send(self.name, COORDINATOR, WorkerReport(self.name, stats, self.holdings(), list(events)))

    def _report_loop(self) -> None:
        """Report every report_s while anything is live here or at the coordinator, then a few more
        (the reconciler needs MIN_REPORTS of them to act); a message arriving starts it again."""
        self.report()
        busy = self.busy() or self.net.nodes[COORDINATOR].live
        if busy or self.quiet_reports < MIN_QUIET_REPORTS:
            self.quiet_reports = 0 if busy else self.quiet_reports + 1
            self.net.timer(self.name, self.net.now + self.cfg.report_s, self._report_loop, readonly=True)
        else:
            self.reporting = False

    def wake(self) -> None:
        """Something arrived: report again if the loop had stopped."""
        if not self.reporting and self.cfg.reports:
            self.reporting, self.quiet_reports = True, 0
            self.net.timer(self.name, self.net.now + self.cfg.report_s, self._report_loop, readonly=True)

    def busy(self) -> bool:
        return bool(self.holdings()) or bool(self.extra_refs()) or self.manager.allocator.num_used > 0

    def holdings(self) -> dict[str, int]:
        raise NotImplementedError


class PrefillWorker(Worker):
    role = "prefill"

    def boot(self) -> None:
        self.jobs: dict[str, Job] = {}
        self.queues: dict[str, list[Job]] = {}  # decode -> jobs waiting for its connection
        self.sessions: dict[str, SenderSession] = {}
        self.metrics = TransferMetrics()
        self.leases = Leases(self.net, self, self.tcfg.lease_s)
        SimSource.workers[self.name] = self
        super().boot()

    def holdings(self) -> dict[str, int]:
        return {j.rid: len(self.manager.table(j.seq).blocks) for j in self.jobs.values()
                if j.seq in self.manager.tables}

    def extra_refs(self) -> dict[int, int]:
        return self.leases.extra_refs()

    def crash(self, wipe: bool) -> None:
        for job in self.jobs.values():
            if job.task is not None:
                job.task.abandon()
        super().crash(wipe)

    def session(self, decode: str) -> SenderSession:
        s = self.sessions.get(decode)
        if s is None:
            advert = SimAdvert(self) if self.net.pull else None
            ch = SimChannel(self.net, self.name, decode, self.tcfg, advert, self.metrics)
            s = self.sessions[decode] = SenderSession(LAYOUT.fingerprint(), self.tcfg, ch,
                                                      metrics=self.metrics, clock=self.net.clock)
        return s

    def on_message(self, env) -> None:
        msg = env.payload
        self.wake()
        if isinstance(msg, Submit):
            self.submit(msg)
        elif isinstance(msg, Abort):
            self.drop(msg.request_id)
        elif isinstance(msg, DropHeld):
            job = self.jobs.get(msg.request_id)
            if job is not None and job.held and job.epoch == msg.epoch:
                self.drop(msg.request_id)
        elif isinstance(msg, list):  # a KV reply: to the connection it answers
            for s in self.sessions.values():
                if s.channel.conn == env.conn:
                    s.channel.arrive(msg)

    def submit(self, cmd: Submit) -> None:
        rid = cmd.request_id
        old = self.jobs.get(rid)
        if old is not None:
            if old.epoch >= cmd.epoch:
                return  # a duplicate, or older than what runs
            self.drop(rid)
        self.ever.add(rid)
        seq = f"{rid}@{cmd.epoch}"
        prompt = list(cmd.prompt_ids) + list(cmd.generated)
        hit = self.manager.allocate(seq, prompt)
        if hit is None:
            self.report(RequestFailed(rid, cmd.epoch, "no_room", f"{self.name}: no room to prefill"))
            return
        job = self.jobs[rid] = Job(rid, cmd.epoch, seq, cmd.decode_worker,
                                   DecodeState(token_ids=prompt + [next_token(prompt)]))
        if self.net.stream:  # migrated while computed: the feed writes the K/V chunk by chunk
            job.feed = StreamFeed(self, job, hit)
            self._queue(job, 0.0)
            return
        write_kv(self.manager, seq, hit, len(prompt))
        self.manager.mark_computed(seq, len(prompt))
        self._queue(job, self.cfg.prefill_s)

    def _queue(self, job: Job, after: float) -> None:
        """Migrate `job` to its decode worker once the jobs queued for it before are done."""
        queue = self.queues.setdefault(job.decode, [])
        queue.append(job)
        if len(queue) == 1:
            self.net.timer(self.name, self.net.now + after, lambda: self._next(job.decode))

    def resend(self, cmd: Resend) -> str | None:
        """The coordinator's Resend (an awaited call, as a reservation): migrate the held blocks to
        another decode worker under the new epoch; the error when the request is not held here."""
        job = self.jobs.get(cmd.request_id)
        if job is None or not job.held:
            return f"request {cmd.request_id} is not held on {self.name}"
        job.held, job.started, job.task = False, False, None
        if job.feed is not None:  # the stream broke, perhaps mid-prefill: the prefill ends first
            while not job.feed.ended:
                job.feed.compute()
        job.feed = None  # a resend sends the held blocks whole
        job.decode, job.epoch = cmd.decode_worker, cmd.epoch
        self._queue(job, 0.0)
        return None

    def _next(self, decode: str) -> None:
        queue = self.queues.get(decode, [])
        while queue and self.jobs.get(queue[0].rid) is not queue[0]:
            queue.pop(0)  # dropped meanwhile
        if not queue or queue[0].started:
            return
        job = queue[0]
        job.started = True
        session = self.session(decode)
        if job.feed is not None:
            prompt = job.state.token_ids[:-1]
            steps = session.migrate_streamed_steps(self.manager, f"{job.rid}/0", job.epoch, prompt, {},
                                                   job.feed)
        else:
            steps = session.migrate_steps(self.manager, job.seq, f"{job.rid}/0", job.epoch, job.state,
                                          leases=self.leases)
        job.task = Task(steps, lambda value, error: self._migrated(job, value, error))
        job.task.start()

    def _migrated(self, job: Job, ack, error) -> None:
        if error is not None and not isinstance(error, TransferError):
            raise Violation(f"{self.name}: the sender's steps raised {type(error).__name__}: {error}")
        if self.jobs.get(job.rid) is job:
            if error is None:
                del self.jobs[job.rid]
                self.manager.free(job.seq)
                self.report(Migrated(job.rid, job.decode, job.epoch, 0.0, 0, 0, 0, 1, "sim"))
            else:  # held for a Resend, as prefill_worker.handler keeps it
                job.held = True
                epoch = job.epoch
                self.net.timer(self.name, self.net.now + self.cfg.hold_s, lambda: self._expire(job, epoch))
                why = f"migration to {job.decode} failed: {type(error).__name__}"
                self.report(RequestFailed(job.rid, job.epoch, "migration", why, held=True))
        queue = self.queues.get(job.decode, [])
        if queue and queue[0] is job:
            queue.pop(0)
        self.net.timer(self.name, self.net.now, lambda: self._next(job.decode))

    def _expire(self, job: Job, epoch: int) -> None:
        """No Resend came within hold_s: the blocks go back, and the coordinator is told."""
        if self.jobs.get(job.rid) is job and job.held and job.epoch == epoch:
            self.drop(job.rid)
            self.report(RequestFailed(job.rid, epoch, "hold_expired",
                                      f"no decode worker took the held KV within {self.cfg.hold_s:g}s"))

    def drop(self, rid: str) -> None:
        """Abort: the migration's steps are abandoned where they wait; its lease runs out by itself."""
        job = self.jobs.pop(rid, None)
        if job is None:
            return
        if job.task is not None and not job.held:
            job.task.abandon()
        self.manager.free(job.seq)
        queue = self.queues.get(job.decode, [])
        if queue and queue[0] is job:
            queue.pop(0)
            self.net.timer(self.name, self.net.now, lambda: self._next(job.decode))


@dataclass
class Running:
    seq: object
    epoch: int
    prompt_len: int
    max_tokens: int
    start: int  # the output position its first token has (tokens generated before a resume)
    generated: list = field(default_factory=list)


class DecodeWorker(Worker):
    role = "decode"

    def boot(self) -> None:
        self.metrics = TransferMetrics()
        self.reserved: dict[str, tuple[int, str, int, int]] = {}  # rid -> (epoch, sender, max tokens, start)
        self.running: dict[str, Running] = {}
        self.receiver = SimReceiver(self.net, self.name, self.manager, self.tcfg, admission=self,
                                    epochs=EpochGuard(), metrics=self.metrics, stage=self.net.stage)
        self.ticking = False
        super().boot()

    def _tick(self) -> None:
        """The receiver's expiry, as its poll loop runs it, while a transfer is in flight."""
        self.receiver.expire()
        self.ticking = bool(self.receiver.active)
        if self.ticking:
            self.net.timer(self.name, self.net.now + min(self.tcfg.idle_timeout_s / 4, 0.1), self._tick)

    def holdings(self) -> dict[str, int]:
        return {rid: len(self.manager.table(r.seq).blocks) for rid, r in self.running.items()}

    def extra_refs(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for p in self.receiver.active.values():
            for b in list(p.session._allocated) + list(p.session._acquired):
                out[b] = out.get(b, 0) + 1
        return out

    # ---- admission (transfer.admission) ------------------------------------------------------------
    def admit_transfer(self, transfer_id: str, epoch: int, peer: str) -> bool:
        r = self.reserved.get(transfer_id.rpartition("/")[0])
        return r is not None and r[:2] == (epoch, peer)

    def admit_query(self, transfer_id: str, peer: str) -> bool:
        r = self.reserved.get(transfer_id.rpartition("/")[0])
        return r is not None and r[1] == peer

    def reserve(self, rid: str, epoch: int, sender: str, max_tokens: int, start: int = 0) -> bool:
        """The coordinator's reservation (an awaited call: no fault touches it), always granted; a
        newer one of a request this worker still runs ends the older attempt here. max_tokens:
        this attempt's; start: the output position of its first token."""
        self.ever.add(rid)
        self._end(rid)
        self.receiver.abort_request(rid)
        self.reserved[rid] = (epoch, sender, max_tokens, start)
        return True

    # ---- messages -------------------------------------------------------------------------------------
    def on_message(self, env) -> None:
        msg = env.payload
        self.wake()
        if isinstance(msg, Abort):
            self.reserved.pop(msg.request_id, None)
            self.receiver.abort_request(msg.request_id)
            self._end(msg.request_id)
            return
        try:
            result = self.receiver.receive(env.conn, msg)
        except TransferError:
            return  # nacked, counted and released by the receiver
        except Exception as e:  # noqa: BLE001 - a receiver that raises anything else crashed
            raise Violation(f"{self.name}: the receiver raised {type(e).__name__}: {e}") from e
        if result is not None:
            self._committed(result)
        if self.receiver.active and not self.ticking:
            self.ticking = True
            self.net.timer(self.name, self.net.now + min(self.tcfg.idle_timeout_s / 4, 0.1), self._tick)

    def _committed(self, result) -> None:
        rid = result.request_id.rpartition("/")[0]
        table = self.manager.table(result.seq_id)
        if not kv_matches(self.manager, result.seq_id, table.num_tokens):
            raise Violation(f"{self.name}: committed {result.request_id!r} with bytes that differ "
                            "from the sender's")
        r = self.reserved.get(rid)
        if r is None or r[0] != result.epoch or rid in self.running:
            self.manager.free(result.seq_id)  # stale: its reservation ended meanwhile
            return
        del self.reserved[rid]
        state = result.state
        run = self.running[rid] = Running(result.seq_id, result.epoch, table.num_tokens, r[2], r[3],
                                          list(state.token_ids[table.num_tokens:]))
        self.report(Imported(rid, 0, result.epoch, len(table.blocks), 0, 0.0))
        if not self.manager.append(run.seq, run.generated):
            self._fail(rid, "no room to decode")
            return
        self.net.timer(self.name, self.net.now + self.cfg.decode_step_s, lambda: self._step(rid, run))

    def _step(self, rid: str, run: Running) -> None:
        if self.running.get(rid) is not run:
            return
        t = self.manager.table(run.seq)
        n = t.num_tokens
        write_kv(self.manager, run.seq, n - 1, n)
        self.manager.mark_computed(run.seq, n)
        if len(run.generated) >= run.max_tokens:
            self._end(rid)
            self.report(Tokens(rid, 0, run.start, list(run.generated), "length"))
            return
        token = next_token(t.token_ids)
        if not self.manager.append(run.seq, [token]):
            self._fail(rid, "no room to decode")
            return
        run.generated.append(token)
        self.net.timer(self.name, self.net.now + self.cfg.decode_step_s, lambda: self._step(rid, run))

    def _fail(self, rid: str, why: str) -> None:
        run = self.running.get(rid)
        self._end(rid)
        self.report(RequestFailed(rid, run.epoch if run else 0, "decode", f"{self.name}: {why}"))

    def _end(self, rid: str) -> None:
        run = self.running.pop(rid, None)
        if run is not None:
            self.manager.free(run.seq)

