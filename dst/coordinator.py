"""The simulated coordinator: production's `coordinator.core.ClusterCore` (routing, the ledger, the
reconciler, failover) over one `ClusterState`, and a driver that does here what
`coordinator.cluster.ClusterBackend` does with Ray and asyncio: it feeds the core what happens
(a request arrives, a decode worker grants room, a worker's report, a worker's death, a liveness
check) at the virtual time, and carries out the actions it returns (`_carry_out`: commands sent
on the simulated network, a rerun prefill, a resend of held blocks, a redispatch, a replacement).

What the driver models of the real one:
- a reservation is an awaited call: no fault touches it (`DecodeWorker.reserve`);
- a dispatch (`Submit`), a resend (`Resend`) and every `Tell` are commands: Ray calls, in order
  per link, only ever late;
- a worker's events reach the core inside its `WorkerReport`s, as production's loop sends them;
- a crash is seen at once, as Ray's ActorDiedError makes it (`crashed`: `mark_dead`, then a
  liveness check), and the replacement comes back under the same name (`Replace`);
- a client's deadline fails the request with a Timeout, a cancel drops it (the HTTP layer's
  `finally`), a supersede dispatches it again under a newer epoch.

`outcomes` is what the clients got: rid -> ("answered", tokens) or ("failed", why). For the
invariants it records `vanished` (each vanished verdict with the worker's ground truth) and
`failed_answered` (requests that failed although every right token had arrived).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from coordinator.backend import FinalEvent
from coordinator.config import ClusterConfig
from coordinator.core import ClusterCore
from coordinator.errors import APIError, ServiceUnavailable, Timeout
from coordinator.metrics import Metrics
from coordinator.state import Action, ClusterState, Redispatch, Replace, ResendHeld, RetryPrefill, Tell
from coordinator.workers import RequestState, WorkerState
from dst.model import LAYOUT, generate
from dst.net import COORDINATOR
from protocol.messages import Submit, WorkerReport

VANISHED = "the KV blocks of the request vanished on "  # the core's verdict, as it words it


@functools.cache
def _metrics() -> Metrics:
    """One registry for every world of the process: it only counts, and a world decides nothing
    from it (placement is `disaggregate=always`)."""
    return Metrics()


@dataclass
class Request:
    """One client's request, as the simulation sees it."""

    rid: str
    prompt: tuple
    max_tokens: int
    arrived: float
    state: RequestState | None = None
    ended: float | None = None


class SimCoordinator:
    name = COORDINATOR
    incarnation = 0

    def __init__(self, net, workers: dict, cfg):
        self.net, self.workers, self.cfg = net, workers, cfg
        config = ClusterConfig(prefill=cfg.prefills, decode=cfg.decodes, routing="least_loaded",
                               ledger_grace_s=-1.0,  # only MIN_REPORTS consecutive reports count
                               heartbeat_timeout_s=cfg.heartbeat_timeout_s, monitor_s=cfg.monitor_s,
                               report_s=cfg.report_s)
        self.state = ClusterState.create(config, _metrics(), clock=net.clock)
        self.core = ClusterCore(self.state)
        for name, w in workers.items():
            self.state.workers[name] = self._worker_state(name, w.role)
        self.requests: dict[str, Request] = {}
        self.live: dict[str, Request] = {}
        self.outcomes: dict[str, tuple] = {}
        # (worker, request, the worker ever had it, lost it, holds it now) per vanished verdict
        self.vanished: list[tuple[str, str, bool, bool, bool]] = []
        self.failed_answered: list[str] = []  # requests failed after every right token arrived
        self.monitoring = False
        net.nodes[self.name] = self

    @property
    def ledger(self):
        return self.state.ledger

    def _worker_state(self, name: str, role: str) -> WorkerState:
        return WorkerState(name, role, handle=None, address=name, block_size=LAYOUT.block_size,
                           stats={"free_blocks": self.cfg.blocks, "total_blocks": self.cfg.blocks},
                           slot=name, last_seen=self.net.now)

    # ---- clients ----------------------------------------------------------------------------------
    def arrive(self, rid: str, prompt: tuple, max_tokens: int) -> None:
        r = self.requests[rid] = Request(rid, prompt, max_tokens, self.net.now)
        try:
            r.state = self.core.route(rid, 1, list(prompt), {"max_tokens": max_tokens}, self.net.now)
        except APIError as e:
            self._end(r, ("failed", f"{type(e).__name__}: {e.message}"))
            return
        self.live[rid] = r
        self.net.timer(self.name, self.net.now + self.cfg.request_timeout_s, lambda: self._deadline(r))
        self._monitor_on()
        self._dispatch(r.state)
        self._collect()

    def _deadline(self, r: Request) -> None:
        if r.rid in self.live:
            self._carry_out(self.core.fail_if_live(r.state, Timeout("the client's deadline passed")))
            self._collect()

    def cancel(self, rid: str) -> None:
        """The client went away: the HTTP layer's `finally` drops the request."""
        r = self.live.get(rid)
        if r is not None:
            self._carry_out(self.core.drop(r.state, ok=False))
            self._end(r, ("failed", "cancelled"))

    def supersede(self, rid: str) -> None:
        """Dispatch a live request again under a newer epoch, on the workers it has (the older
        attempt is left to the epochs and the decode worker's new reservation)."""
        r = self.live.get(rid)
        if r is None or all(r.state.done):
            return
        r.state.migration, r.state.decoded = None, False
        self._dispatch(r.state)
        self._collect()

    # ---- the driver: dispatch, reserve, resend --------------------------------------------------
    def _dispatch(self, request: RequestState) -> None:
        epoch = self.core.reservation_epoch(request)
        if epoch is not None and not self._reserve(request, epoch):
            return
        worker, cmd = self.core.submit_command(request)
        self.net.send(self.name, worker.name, cmd)

    def _reserve(self, request: RequestState, epoch: int) -> bool:
        """Ask the decode workers the core lists for room (an awaited call: no fault touches it);
        False when the request failed meanwhile (no live decode worker, or none granted)."""
        try:
            candidates = self.core.reserve_candidates(request, self.net.now)
        except APIError as e:
            self._carry_out(self.core.fail_if_live(request, e))
            return False
        max_tokens = request.params["max_tokens"] - len(request.generated)
        for worker in candidates:
            if self.workers[worker.name].reserve(request.rid, epoch, request.prefill, max_tokens,
                                                 len(request.generated)):
                taken, actions = self.core.reserved(request, worker)
                self._carry_out(actions)
                return taken
            self.core.refused(worker)
        self._carry_out(self.core.fail_if_live(request, ServiceUnavailable("decode workers full")))
        return False

    def _resend(self, request: RequestState, bad: str, why: str) -> None:
        epoch = self.core.begin_resend(request, bad)
        if epoch is None:
            return
        try:
            if not self._reserve(request, epoch):
                return
            worker, cmd = self.core.resend_command(request)
            error = self.workers[worker.name].resend(cmd)  # its reply: an awaited call, as a reservation
            self._carry_out(self.core.resent(request, bad, why, error, self.net.now))
        finally:
            self.core.end_resend(request)

    def _carry_out(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Tell):
                self.net.send(self.name, action.worker.name, action.command)
            elif isinstance(action, (RetryPrefill, Redispatch)):
                self._dispatch(action.request)
            elif isinstance(action, ResendHeld):
                self._resend(action.request, action.bad, action.why)
            elif isinstance(action, Replace):  # the crashed worker came back under its name
                name = action.worker.name
                self.state.workers[name] = self._worker_state(name, action.worker.role)
            else:
                raise TypeError(f"unknown action {action!r}")

    # ---- what workers say, and their deaths ----------------------------------------------------
    def on_message(self, env) -> None:
        msg = env.payload
        if not isinstance(msg, WorkerReport):
            raise TypeError(f"the coordinator got {type(msg).__name__}")
        self._carry_out(self.core.on_message(msg, self.net.now))
        for r, why in self._collect():  # the reconciler's verdicts, with the worker's ground truth now
            if why.startswith(VANISHED + msg.worker):
                w = self.workers[msg.worker]
                self.vanished.append((msg.worker, r.rid, r.rid in w.ever, r.rid in w.lost,
                                      r.rid in w.holdings()))

    def crashed(self, name: str) -> None:
        """Ray says the worker's process died: routing skips it and the core fails over at once."""
        self.core.mark_dead(name, "ActorDiedError")
        self._carry_out(self.core.check_liveness(self.net.now))
        self._carry_out(self.core.check_liveness(self.net.now))  # the replacement is live again
        self._collect()

    def _monitor_on(self) -> None:
        if not self.monitoring and self.cfg.reports:  # without reports no heartbeat keeps a worker live
            self.monitoring = True
            self.net.timer(self.name, self.net.now + self.cfg.monitor_s, self._monitor)

    def _monitor(self) -> None:
        self._carry_out(self.core.check_liveness(self.net.now))
        self._collect()
        self.monitoring = bool(self.live)
        if self.monitoring:
            self.net.timer(self.name, self.net.now + self.cfg.monitor_s, self._monitor)

    # ---- what the clients got -----------------------------------------------------------------------
    def _collect(self) -> list[tuple[Request, str]]:
        """End every live request whose queue says it ended (a final event or an error); returns
        the failed ones with their errors' messages."""
        failed = []
        for r in list(self.live.values()):
            q = r.state.q
            while not q.empty():
                item = q.get_nowait()
                if isinstance(item, FinalEvent):
                    self._end(r, ("answered", tuple(r.state.tokens[0])))
                    break
                if isinstance(item, APIError):
                    complete = tuple(r.state.tokens[0]) == tuple(generate(list(r.prompt), r.max_tokens))
                    if complete and not (isinstance(item, Timeout) and self._report_coming(r)):
                        self.failed_answered.append(r.rid)
                    self._end(r, ("failed", f"{type(item).__name__}: {item.message}"))
                    failed.append((r, item.message))
                    break
        return failed

    def _report_coming(self, r: Request) -> bool:
        """Whether the migration's outcome is still to reach the coordinator: a report of it on its
        way, the prefill worker's Submit on its way (a late command), or the prefill worker still at
        it. A request whose every token arrived may time out waiting for that report (a slow link);
        waiting for one that can never come is a bug."""
        prefill = r.state.prefill
        for ev in self.net.pending:
            msg = ev.envelope.payload if ev.envelope is not None else None
            if isinstance(msg, WorkerReport) and msg.worker == prefill and any(
                    getattr(e, "request_id", None) == r.rid for e in msg.events):
                return True
            if isinstance(msg, Submit) and ev.dst == prefill and msg.request_id == r.rid:
                return True
        worker = self.workers.get(prefill)
        return worker is not None and worker.role == "prefill" and r.rid in worker.jobs

    def _end(self, r: Request, outcome: tuple) -> None:
        self.live.pop(r.rid, None)
        r.ended = self.net.now
        self.outcomes[r.rid] = outcome
