"""The simulated coordinator: the real ledger, reconciler and router, and the request flow around
them that `coordinator.cluster` runs (that module is not used: it is async and Ray's).

A request is opened in the ledger, given a prefill and a decode worker by the router, reserved on
the decode worker under the MIGRATING move's epoch (the ledger's + 2), moved to PREFILLING and
submitted. Events advance it (Migrated -> MIGRATING, Imported/Tokens -> DECODING) and it is
answered once every token arrived and the migration was reported; it fails on a failed
migration, a vanished verdict of the reconciler, a restarted worker, the client's cancel or its
deadline - unless every token arrived already, then it is answered. Every report is recorded in
the ledger and checked by the reconciler (grace 0: only its MIN_REPORTS consecutive reports
count, so the verdicts are deterministic); orphans are aborted.
`outcomes` is what the clients got: rid -> ("answered", tokens) or ("failed", why).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.ledger import Ledger, Phase
from coordinator.reconcile import Reconciler
from coordinator.router import Router, WorkerLoad
from dst.control_messages import (
    COORDINATOR,
    Abort,
    Imported,
    Migrated,
    MigrationFailed,
    Report,
    Submit,
    Tokens,
)
from dst.model import generate


@dataclass
class Request:
    rid: str
    prompt: tuple
    max_tokens: int
    arrived: float
    prefill: str = ""
    decode: str = ""
    epoch: int = 0
    tokens: tuple | None = None
    migrated: bool = False
    ended: float | None = None
    discrepancies: list = field(default_factory=list)


class SimCoordinator:
    name = COORDINATOR
    incarnation = 0

    def __init__(self, net, workers: dict, cfg):
        self.net, self.workers, self.cfg = net, workers, cfg
        self.ledger = Ledger()
        self.counts: dict[str, int] = {}
        self.reconciler = Reconciler(self.ledger, grace_s=-1.0, count=self._count)
        self.routers = {"prefill": Router("least_loaded"), "decode": Router("least_loaded")}
        self.loads: dict[str, WorkerLoad] = {n: WorkerLoad(n, cfg.blocks) for n in workers}
        self.seen_incarnation = {n: 0 for n in workers}
        self.requests: dict[str, Request] = {}
        self.live: dict[str, Request] = {}
        self.outcomes: dict[str, tuple] = {}
        # (worker, request, the worker ever had it, lost it, holds it now) per vanished verdict
        self.vanished: list[tuple[str, str, bool, bool, bool]] = []
        self.failed_answered: list[str] = []  # requests failed after every right token arrived
        net.nodes[self.name] = self

    def _count(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def _pick(self, role: str, prompt) -> str:
        loads = [w for n, w in self.loads.items() if self.workers[n].role == role]
        return self.routers[role].pick(loads, role, list(prompt))

    # ---- clients ----------------------------------------------------------------------------------
    def arrive(self, rid: str, prompt: tuple, max_tokens: int) -> None:
        r = self.requests[rid] = self.live[rid] = Request(rid, prompt, max_tokens, self.net.now)
        self.ledger.open(rid)
        r.prefill, r.decode = self._pick("prefill", prompt), self._pick("decode", prompt)
        self._dispatch(r)
        deadline = self.net.now + self.cfg.request_timeout_s
        self.net.timer(self.name, deadline, lambda: self._fail(r, "timeout") if rid in self.live else None)

    def _dispatch(self, r: Request) -> None:
        r.epoch = self.ledger.get(r.rid).epoch + 2
        self.workers[r.decode].reserve(r.rid, r.epoch, r.prefill, r.max_tokens)
        self.ledger.move(r.rid, Phase.PREFILLING, r.prefill)
        self.net.send(self.name, r.prefill, Submit(r.rid, r.prompt, r.max_tokens, r.decode, r.epoch))

    def cancel(self, rid: str) -> None:
        r = self.live.get(rid)
        if r is not None:
            self._fail(r, "cancelled")

    def supersede(self, rid: str) -> None:
        """Rerun a live request under a newer epoch (as failover does), perhaps elsewhere."""
        r = self.live.get(rid)
        if r is None or r.tokens is not None:
            return
        r.prefill, r.migrated = self._pick("prefill", r.prompt), False
        self._dispatch(r)

    # ---- workers ----------------------------------------------------------------------------------
    def on_message(self, env) -> None:
        msg = env.payload
        if isinstance(msg, Report):
            self._report(msg)
            return
        r = self.live.get(msg.rid)
        if r is None or msg.epoch != r.epoch or msg.worker not in (r.prefill, r.decode):
            return  # finished, failed, or from an earlier attempt
        if isinstance(msg, Migrated):
            self._advance(r, Phase.MIGRATING)
            r.migrated = True
        elif isinstance(msg, Imported):
            self._advance(r, Phase.DECODING)
        elif isinstance(msg, Tokens):
            self._advance(r, Phase.DECODING)
            r.tokens = tuple(msg.tokens)
        elif isinstance(msg, MigrationFailed):
            self._fail(r, f"{msg.worker}: {msg.why}")
            return
        if r.tokens is not None and r.migrated:
            self._end(r, ok=True)

    def _advance(self, r: Request, phase: Phase) -> None:
        order = [Phase.PREFILLING, Phase.MIGRATING, Phase.DECODING]
        entry = self.ledger.get(r.rid)
        if entry.phase not in order or order.index(entry.phase) >= order.index(phase):
            return
        for step in order[order.index(entry.phase) + 1:order.index(phase) + 1]:
            self.ledger.move(r.rid, step, r.decode)

    def _report(self, rep: Report) -> None:
        load = self.loads[rep.worker]
        load.free_blocks = self.cfg.blocks - rep.used_blocks
        if rep.incarnation != self.seen_incarnation[rep.worker]:  # it restarted: what ran there is lost
            self.seen_incarnation[rep.worker] = rep.incarnation
            self.reconciler.forget_worker(rep.worker)
            self.ledger.forget_worker(rep.worker)
            for r in [r for r in self.live.values() if rep.worker in (r.prefill, r.decode)]:
                self._fail(r, f"{rep.worker} restarted")
        self.ledger.record(rep.worker, rep.holdings)
        assigned = {rid: {r.prefill, r.decode} for rid, r in self.live.items()}
        generated = frozenset(rid for rid, r in self.live.items() if r.tokens is not None)
        orphans, vanished = self.reconciler.check(rep.worker, rep.role, {"used_blocks": rep.used_blocks},
                                                  rep.holdings, assigned, generated)
        for rid in orphans:
            self.net.send(self.name, rep.worker, Abort(rid))
        for rid in vanished:
            r = self.live.get(rid)
            if r is not None:
                w = self.workers[rep.worker]  # ground truth at the verdict: had it, lost it, holds it
                self.vanished.append((rep.worker, rid, rid in w.ever, rid in w.lost, rid in w.holdings()))
                self._fail(r, f"blocks vanished on {rep.worker}", verdict=True)

    # ---- ends -------------------------------------------------------------------------------------
    def _fail(self, r: Request, why: str, verdict: bool = False) -> None:
        """End `r` failed; but a request whose every token arrived is answered (its decode worker
        finished it: a lost ack, a late Migrated report or a restart after it cannot undo that),
        except on the reconciler's verdict, which must never reach such a request."""
        if r.tokens is not None and why != "cancelled":
            if verdict and r.tokens == tuple(generate(list(r.prompt), r.max_tokens)):
                self.failed_answered.append(r.rid)
            elif not verdict:
                self._end(r, ok=True)
                return
        self._end(r, ok=False, why=why)

    def _end(self, r: Request, ok: bool, why: str = "") -> None:
        self.live.pop(r.rid, None)
        r.ended = self.net.now
        self.ledger.close(r.rid, ok)
        self.outcomes[r.rid] = ("answered", r.tokens) if ok else ("failed", why)
        for worker in {r.prefill, r.decode} if not ok else {r.decode}:
            self.net.send(self.name, worker, Abort(r.rid))
