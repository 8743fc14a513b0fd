"""Which workers make up the cluster, decided without I/O: `Membership`.

The worker table's changes, as plain methods on the one coordinator.state.ClusterState: the
workers placed at start, a worker joining (after its handshakes), a lost worker's replacement
(one at a time, after a backoff that doubles with each recent replacement of its slot; past
`max_restarts` per `restart_window_s`, a steady `restart_max_backoff_s`, never giving up; and
none for a worker that reported again meanwhile), a drain (out of routing at once; idle once no
request needs it and it holds no blocks; past its timeout its requests move by coordinator.core's
failover paths), a retired slot (never replaced nor reused) and a scale (one at a time, within
bounds, the least busy workers drained first). Nothing here awaits, calls Ray or reads a clock:
the driver (coordinator.lifecycle's Fleet, coordinator.drain's Drainer) does the waiting and
the actor calls, and passes the time in.
"""

from __future__ import annotations

import logging

from coordinator.core import ClusterCore
from coordinator.errors import APIError, InvalidRequest, ServiceUnavailable
from coordinator.ledger import Phase
from coordinator.state import Action, Tell
from coordinator.workers import RequestState, WorkerState
from protocol.messages import Abort

log = logging.getLogger(__name__)

MAX_WORKERS_PER_ROLE = 64  # the most workers a scale asks for in one role


class Membership:
    """Decides the worker table's changes (see the module docstring); `core` moves the requests."""

    def __init__(self, core: ClusterCore):
        self.core, self.state = core, core.state

    # ---- the worker table -------------------------------------------------------------------------
    def place(self, workers: dict[str, WorkerState]) -> None:
        """The workers placed at start: in the table at once (their first reports arrive there),
        routed to once the driver's start has brought them all up."""
        self.state.workers.update(workers)

    def clear_workers(self) -> None:
        """Every worker was ended (the cluster closes)."""
        self.state.workers.clear()

    def live(self, role: str, now: float) -> list[WorkerState]:
        """Workers of `role` alive at `now` and not lost."""
        s = self.state
        timeout = s.config.heartbeat_timeout_s
        return [w for w in s.role(role) if w.alive(timeout, now) and w.name not in s.lost]

    # ---- draining and scaling ---------------------------------------------------------------------
    def staying(self, role: str) -> list[WorkerState]:
        """Workers of `role` that are neither draining nor lost."""
        s = self.state
        return [w for w in s.role(role) if w.name not in s.draining and w.name not in s.lost]

    def needing(self, worker: WorkerState) -> list[RequestState]:
        """Requests that still need `worker`: its decode (or colocated) requests until they finish,
        its prefill requests until their KV has migrated and decoding started elsewhere."""
        out = []
        for request in self.state.requests.values():
            if request.decode == worker.name and not request.finished:
                out.append(request)
            elif request.prefill == worker.name and (request.migration is None or not request.decoded):
                out.append(request)
        return out

    def idle(self, worker: WorkerState) -> bool:
        """No request needs the worker and its last report holds no request's blocks."""
        return not self.needing(worker) and not worker.holdings

    def check_drain(self, name: str) -> WorkerState:
        """The worker `name`, if it may be drained now: WorkerNotFound, or Conflict when it is
        already draining, lost, or the last of its role that stays."""
        s = self.state
        worker = s.workers.get(name)
        if worker is None:
            raise WorkerNotFound(f"no worker named {name!r} (GET /v1/cluster lists them)", param="name")
        if name in s.draining:
            raise Conflict(f"worker {name} is already draining")
        if name in s.lost:
            raise Conflict(f"worker {name} is not alive; it is being replaced")
        if len(self.staying(worker.role)) <= 1:
            raise Conflict(f"worker {name} is the last live {worker.role} worker: add one first "
                           f"(POST /v1/cluster/scale)")
        return worker

    def begin_scale(self, targets: dict) -> None:
        """A scale to `targets` (role -> workers) starts: InvalidRequest for a role this cluster
        lacks or a count out of range, Conflict while another scale is under way."""
        s = self.state
        for role, count in targets.items():
            if role not in s.roles:
                raise InvalidRequest(f"this cluster's roles are {', '.join(s.roles)}, not {role!r}",
                                     param=role)
            if type(count) is not int or not 1 <= count <= MAX_WORKERS_PER_ROLE:
                raise InvalidRequest(f"'{role}' must be an integer in 1..{MAX_WORKERS_PER_ROLE}", param=role)
        if s.scaling:
            raise Conflict("a scale is already under way")
        s.scaling = True

    def end_scale(self) -> None:
        self.state.scaling = False

    def begin_drain(self, worker: WorkerState, now: float) -> None:
        """From here `loads` leaves the worker out: no new request goes to it."""
        self.state.draining[worker.name] = now
        self.state.routers[worker.role].forget(worker.name)

    def end_drain(self, worker: WorkerState) -> None:
        self.state.draining.pop(worker.name, None)

    def move_off(self, worker: WorkerState, why: str, now: float) -> tuple[list[Action], int, int]:
        """A drain's timeout passed: move (or fail, colocated) what still needs the worker.
        Returns the actions and how many requests moved and failed."""
        s, actions, moved, failed = self.state, [], 0, 0
        for request in self.needing(worker):
            entry = s.ledger.get(request.rid)
            if entry is None or entry.phase is Phase.QUEUED or request.resending:
                continue  # still reserving (which skips a draining worker) or already being moved
            if worker.role == "colocated":
                actions += self.core.fail(request, ServiceUnavailable(f"{why}; the request was stopped"))
                failed += 1
            elif request.decode == worker.name:
                actions += self.core.resume(request, worker.name, why, now)
                moved += 1
            elif request.migration is None and not request.decoded:
                actions.append(Tell(worker, Abort(request.rid)))
                actions += self.core.retry_prefill(request, worker.name, now)
                moved += 1
        return actions, moved, failed

    def retire(self, worker: WorkerState) -> list[Action]:
        """The worker leaves for good: out of the tables, its slot retired (never replaced). The
        returned aborts give back what a migration cut short still holds there."""
        s, slot = self.state, worker.slot or worker.name
        s.retired.add(slot)
        s.workers.pop(worker.name, None)
        s.lost.discard(worker.name)
        s.ledger.forget_worker(worker.name)
        s.reconciler.forget_worker(worker.name)
        s.routers[worker.role].forget(worker.name)
        s.slot_status.pop(slot, None)
        s.restarts.pop(slot, None)
        return [Tell(worker, Abort(rid)) for rid in list(worker.holdings)]

    def surplus(self, role: str, count: int) -> list[WorkerState]:
        """The `count` staying workers of `role` to drain: the least busy first."""
        return sorted(self.staying(role), key=lambda w: (len(self.needing(w)), w.name))[:count]

    def fresh_slot(self, role: str) -> str:
        """The first "<role>-<i>" never used by this cluster (retired slots are not reused: Ray may
        still hold the old actor's name for a moment), reserved until `joined` frees it, so a
        concurrent add cannot take it."""
        s = self.state
        used = {w.slot or w.name for w in (*s.workers.values(), *s.joining.values())} | s.retired
        i = 0
        while f"{role}-{i}" in used:
            i += 1
        s.retired.add(f"{role}-{i}")
        return f"{role}-{i}"

    # ---- replacing lost workers -------------------------------------------------------------------
    def begin_replace(self, dead: WorkerState) -> bool:
        """Whether to start replacing `dead`: one replacement per lost worker at a time, and none
        when `max_restarts` is 0 (replacement off)."""
        s = self.state
        if dead.name in s.replacing or s.config.max_restarts <= 0:
            return False
        s.replacing.add(dead.name)
        return True

    def end_replace(self, dead: WorkerState) -> None:
        self.state.replacing.discard(dead.name)
        self.state.slot_status.pop(dead.slot or dead.name, None)

    def replace_backoff(self, dead: WorkerState, now: float) -> tuple[float, str]:
        """Before one try at replacing `dead`: (seconds to wait first, why it is gone); the slot's
        status says so meanwhile."""
        c, slot = self.state.config, dead.slot or dead.name
        delay, tries = self.restart_delay(slot, now)
        why = dead.why_not_alive(c.heartbeat_timeout_s, now) or "lost"
        self.state.slot_status[slot] = (f"{dead.name} {why}; replacement try {tries + 1} in {delay:g}s "
                                        f"({tries} within the last {c.restart_window_s:g}s)")
        if tries >= c.max_restarts:
            log.error("worker slot %s: %d replacements within %gs; trying again in %gs", slot, tries,
                      c.restart_window_s, delay)
        return delay, why

    def replacing_with(self, dead: WorkerState, worker: WorkerState, why: str, now: float) -> None:
        """`worker` was placed to replace `dead`: a restart of the slot at `now`; it joins next."""
        slot = dead.slot or dead.name
        self.state.restarts.setdefault(slot, []).append(now)
        self.begin_join(worker)
        self.state.slot_status[slot] = f"{dead.name} {why}; replacement {worker.name} is starting"

    def replace_failed(self, dead: WorkerState) -> None:
        """The replacement did not join: the next try gets a fresh name."""
        self.state.metrics.count_error("restart_failed")
        dead.generation += 1

    def begin_join(self, worker: WorkerState) -> None:
        """A placed worker handshakes: its reports update its stats; nothing is routed to it yet."""
        self.state.joining[worker.name] = worker

    def end_join(self, worker: WorkerState) -> None:
        self.state.joining.pop(worker.name, None)

    def restart_delay(self, slot: str, now: float) -> tuple[float, int]:
        """(seconds to wait before the next try for `slot`, tries within the window so far): a
        backoff that doubles per recent replacement; past `max_restarts` per `restart_window_s`, a
        bounded, steady `restart_max_backoff_s`."""
        c = self.state.config
        recent = self.state.restarts.setdefault(slot, [])
        recent[:] = [t for t in recent if now - t < c.restart_window_s]
        if len(recent) >= c.max_restarts:
            self.state.metrics.count_error("restart_limit")
            return c.restart_max_backoff_s, len(recent)
        return min(c.restart_backoff_s * 2 ** len(recent), c.restart_max_backoff_s), len(recent)

    def still_lost(self, dead: WorkerState) -> bool:
        """After the backoff: is a replacement still wanted? Not when the slot was drained away
        meanwhile, nor when the worker reported again (slow, not dead)."""
        if (dead.slot or dead.name) in self.state.retired:
            return False
        if dead.name not in self.state.lost:
            log.warning("worker %s came back: not replaced", dead.name)
            return False
        return True

    def joined(self, worker: WorkerState, replaces: WorkerState | None = None) -> None:
        """`worker` passed its handshakes: routing sees it from now on (in place of `replaces`)."""
        s = self.state
        s.workers[worker.name] = worker
        if replaces is None:
            s.retired.discard(worker.slot)  # its slot was reserved by fresh_slot
            return
        s.workers.pop(replaces.name, None)
        s.lost.discard(replaces.name)
        s.metrics.count_restart(replaces.role)


class WorkerNotFound(APIError):
    """404: no worker of that name in the cluster."""

    status, type, kind = 404, "invalid_request_error", "worker_not_found"


class Conflict(APIError):
    """409: the worker is already draining, the last of its role, or a scale is under way."""

    status, type, kind = 409, "invalid_request_error", "conflict"
