"""Draining and scaling workers while the cluster runs: `Drainer`, the I/O half (waits, timers,
actor calls); the decisions are coordinator.membership's.

`drain_worker(name)` takes a worker out of routing at once (coordinator.core leaves it out of
`loads`, so neither the routers nor the decode reservations pick it), lets the requests that need
it finish there (a prefill worker: until each has migrated and it holds no blocks; a decode or
colocated worker: until each finished), at most `timeout_s`; the requests still on it then move
by the failover paths (a decode worker's: prefill again with prompt + the tokens streamed so far,
on another decode worker; a prefill worker's unmigrated ones: rerun on another prefill worker; a
colocated worker's: fail with 503). Decode requests move by re-prefill, not by a decode-to-decode
KV migration: the transfer protocol moves KV from prefill to decode only, and a re-prefill of
prompt + generated tokens gives the same greedy tokens. Then the worker leaves: it is removed from
the worker table, the ledger and the routers, shut down and killed, and its slot is retired (never
replaced). `scale({"prefill": P, "decode": D})` adds workers, which enter routing only after the
same handshakes as a replacement (coordinator.lifecycle), or drains the surplus, least busy first.
Both refuse what would leave a role without a worker, and one scale at a time; both run as tasks
shielded from the HTTP request, so a client that goes away does not leave a half-drained worker.
Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from coordinator.membership import Membership
from coordinator.state import Action
from coordinator.tasks import Tasks
from coordinator.workers import WorkerState

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often a drain looks at the requests that still need the worker


class WorkerPool(Protocol):
    """What a drain and a scale need of the worker actors (coordinator.lifecycle.Fleet)."""

    async def add(self, role: str) -> str:
        """Place a new worker of `role`; its name once it joined routing."""

    async def leave(self, worker: WorkerState) -> None:
        """End a worker that left the tables."""


class Drainer:
    def __init__(self, members: Membership, pool: WorkerPool, tasks: Tasks,
                 carry_out: Callable[[list[Action]], None]):
        """carry_out: the driver's hand for the actions the core returns (coordinator.cluster)."""
        self.members, self.state, self.pool = members, members.state, pool
        self.tasks, self.carry_out = tasks, carry_out

    async def drain_worker(self, name: str, timeout_s: float | None = None) -> dict:
        """Drain `name` (see the module docstring); returns what happened. WorkerNotFound, Conflict."""
        worker = self.members.check_drain(name)
        return await self.tasks.shielded(self._drain(worker, self._timeout(timeout_s)))

    def _timeout(self, timeout_s: float | None) -> float:
        return self.state.config.drain_timeout_s if timeout_s is None else timeout_s

    async def _drain(self, worker: WorkerState, timeout_s: float) -> dict:
        start = time.monotonic()
        self.members.begin_drain(worker, start)
        log.warning("draining worker %s (at most %gs)", worker.name, timeout_s)
        moved = failed = 0
        try:
            idle = await self._until_idle(worker, start + timeout_s)
            if not idle:
                why = f"worker {worker.name} drained (timeout {timeout_s:g}s)"
                actions, moved, failed = self.members.move_off(worker, why, time.monotonic())
                self.carry_out(actions)
                # the moves take the requests off it at once; what a migration in flight still holds
                # is released by the abort at retirement
                await self._until_idle(worker, time.monotonic() + self.state.config.call_timeout_s)
            used = int(worker.stats.get("used_blocks", 0))
            self.carry_out(self.members.retire(worker))
            await self.pool.leave(worker)
        finally:
            self.members.end_drain(worker)
        result = {"worker": worker.name, "role": worker.role, "slot": worker.slot or worker.name,
                  "finished_in_place": idle, "moved": moved, "failed": failed,
                  "used_blocks_at_exit": used, "seconds": round(time.monotonic() - start, 3)}
        log.warning("worker %s drained: %s", worker.name, result)
        return result

    async def _until_idle(self, worker: WorkerState, deadline: float) -> bool:
        """True once the worker is idle (coordinator.membership); False at the deadline."""
        while not self.members.idle(worker):
            if time.monotonic() >= deadline or worker.name not in self.state.workers:
                return False
            await asyncio.sleep(POLL_S)
        return True

    async def scale(self, targets: dict, timeout_s: float | None = None) -> dict:
        """Bring each role named in `targets` to that many workers (see the module docstring)."""
        self.members.begin_scale(targets)  # NOTE: the task ends it: a client gone must not end it early
        return await self.tasks.shielded(self._scale(targets, self._timeout(timeout_s)))

    async def _scale(self, targets: dict, timeout_s: float) -> dict:
        try:
            return await self._scale_roles(targets, timeout_s)
        finally:
            self.members.end_scale()

    async def _scale_roles(self, targets: dict, timeout_s: float) -> dict:
        added, drained, errors = [], [], []
        for role in self.state.roles:  # NOTE: prefill joins first, so new decode workers handshake with it
            if role not in targets:
                continue
            more = targets[role] - len(self.members.staying(role))
            if more > 0:
                done = await asyncio.gather(*(self.pool.add(role) for _ in range(more)),
                                            return_exceptions=True)
                added += [w for w in done if isinstance(w, str)]
                errors += [f"a new {role} worker did not join: {e}" for e in done if not isinstance(e, str)]
            elif more < 0:
                surplus = [self._drain(w, timeout_s) for w in self.members.surplus(role, -more)]
                done = await asyncio.gather(*surplus, return_exceptions=True)
                drained += [d for d in done if isinstance(d, dict)]
                errors += [f"drain failed: {e!r}" for e in done if not isinstance(e, dict)]
        result = {"added": added, "drained": drained, "errors": errors,
                  "workers": {role: sorted(w.name for w in self.members.staying(role))
                              for role in self.state.roles}}
        log.warning("scaled to %s", result["workers"])
        return result
