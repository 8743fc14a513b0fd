"""Draining and scaling workers while the cluster runs, as a mixin of `ClusterBackend` (through
coordinator.lifecycle). `drain_worker(name)` takes a worker out of routing at once (it is left out
of `_loads`, so neither the routers nor the decode reservations pick it), lets the requests that
need it finish there (a prefill worker: until each has migrated and it holds no blocks; a decode
or colocated worker: until each finished), at most `timeout_s`; the requests still on it then move
by the existing failover paths (a decode worker's: prefill again with prompt + the tokens streamed
so far, on another decode worker; a prefill worker's unmigrated ones: rerun on another prefill
worker; a colocated worker's: fail with 503). Decode requests move by re-prefill, not by a
decode-to-decode KV migration: the transfer protocol moves KV from prefill to decode only, and a
re-prefill of prompt + generated tokens gives the same greedy tokens. Then the worker leaves: it is
removed from the worker table, the ledger and the routers, shut down and killed, and its slot is
retired (never replaced). `scale({"prefill": P, "decode": D})` adds workers, which enter routing
only after the same handshakes as a replacement (coordinator.lifecycle `_join`), or drains the
surplus, least busy first. Both refuse what would leave a role without a worker, and one scale at
a time; both run as tasks shielded from the HTTP request, so a client that goes away does not
leave a half-drained worker. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import logging
import time

from coordinator.errors import APIError, InvalidRequest, ServiceUnavailable
from coordinator.ledger import Phase
from coordinator.workers import call, spawn_worker, tell
from protocol.messages import Abort

log = logging.getLogger(__name__)

MAX_WORKERS_PER_ROLE = 64  # the most workers `scale` asks for in one role
POLL_S = 0.05              # how often a drain looks at the requests that still need the worker


class WorkerNotFound(APIError):
    """404: no worker of that name in the cluster."""

    status, type, kind = 404, "invalid_request_error", "worker_not_found"


class Conflict(APIError):
    """409: the worker is already draining, the last of its role, or a scale is under way."""

    status, type, kind = 409, "invalid_request_error", "conflict"


class DrainMixin:
    """Needs from the host class: config, roles, workers, routers, ledger, reconciler, draining,
    _retired, _requests, _lost, _joining, _role, _spawn, _resume, _retry_prefill, _drop, _join,
    _kv_host, _pull, _published, keys, namespace, slot_status, _restarts (coordinator.cluster)."""

    # ---- draining -------------------------------------------------------------------------------
    async def drain_worker(self, name: str, timeout_s: float | None = None) -> dict:
        """Drain `name` (see the module docstring); returns what happened. WorkerNotFound, Conflict."""
        worker = self.workers.get(name)
        if worker is None:
            raise WorkerNotFound(f"no worker named {name!r} (GET /v1/cluster lists them)", param="name")
        if name in self.draining:
            raise Conflict(f"worker {name} is already draining")
        if name in self._lost:
            raise Conflict(f"worker {name} is not alive; it is being replaced")
        if len(self._staying(worker.role)) <= 1:
            raise Conflict(f"worker {name} is the last live {worker.role} worker: add one first "
                           f"(POST /v1/cluster/scale)")
        return await self._shielded(self._drain(worker, self._drain_timeout(timeout_s)))

    def _staying(self, role: str) -> list:
        """Workers of `role` that are neither draining nor lost."""
        return [w for w in self._role(role) if w.name not in self.draining and w.name not in self._lost]

    def _drain_timeout(self, timeout_s: float | None) -> float:
        return self.config.drain_timeout_s if timeout_s is None else timeout_s

    async def _shielded(self, coro):
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    async def _drain(self, worker, timeout_s: float) -> dict:
        start = time.monotonic()
        self.draining[worker.name] = start  # NOTE: from here `_loads` leaves it out: no new request
        self.routers[worker.role].forget(worker.name)
        log.warning("draining worker %s (at most %gs)", worker.name, timeout_s)
        moved = failed = 0
        try:
            idle = await self._until_idle(worker, start + timeout_s)
            if not idle:
                moved, failed = self._move_off(worker, timeout_s)
                # the moves take the requests off it at once; what a migration in flight still holds
                # is released by the abort at retirement
                await self._until_idle(worker, time.monotonic() + self.config.call_timeout_s)
            used = int(worker.stats.get("used_blocks", 0))
            await self._retire(worker)
        finally:
            self.draining.pop(worker.name, None)
        result = {"worker": worker.name, "role": worker.role, "slot": worker.slot or worker.name,
                  "finished_in_place": idle, "moved": moved, "failed": failed,
                  "used_blocks_at_exit": used, "seconds": round(time.monotonic() - start, 3)}
        log.warning("worker %s drained: %s", worker.name, result)
        return result

    def _needing(self, worker) -> list:
        """Requests that still need `worker`: its decode (or colocated) requests until they finish,
        its prefill requests until their KV has migrated and decoding started elsewhere."""
        out = []
        for request in self._requests.values():
            if request.decode == worker.name and not request.finished:
                out.append(request)
            elif request.prefill == worker.name and (request.migration is None or not request.decoded):
                out.append(request)
        return out

    async def _until_idle(self, worker, deadline: float) -> bool:
        """True once no request needs the worker and its last report holds no request's blocks;
        False at the deadline."""
        while self._needing(worker) or worker.holdings:
            if time.monotonic() >= deadline or worker.name not in self.workers:
                return False
            await asyncio.sleep(POLL_S)
        return True

    def _move_off(self, worker, timeout_s: float) -> tuple[int, int]:
        """The drain's timeout passed: move (or fail, colocated) what still needs the worker."""
        why, moved, failed = f"worker {worker.name} drained (timeout {timeout_s:g}s)", 0, 0
        for request in self._needing(worker):
            entry = self.ledger.get(request.rid)
            if entry is None or entry.phase is Phase.QUEUED or request.resending:
                continue  # still reserving (which skips a draining worker) or already being moved
            if worker.role == "colocated":
                self._drop(request, ok=False)
                request.q.put_nowait(ServiceUnavailable(f"{why}; the request was stopped"))
                failed += 1
            elif request.decode == worker.name:
                self._resume(request, worker.name, why)
                moved += 1
            elif request.migration is None and not request.decoded:
                tell(worker, Abort(request.rid))
                self._spawn(self._retry_prefill(request, worker.name))
                moved += 1
        return moved, failed

    async def _retire(self, worker) -> None:
        """The worker leaves for good: out of the tables, its slot retired, its process ended."""
        import ray

        slot = worker.slot or worker.name
        self._retired.add(slot)
        self.workers.pop(worker.name, None)
        self._lost.discard(worker.name)
        self.ledger.forget_worker(worker.name)
        self.reconciler.forget_worker(worker.name)
        self.routers[worker.role].forget(worker.name)
        self.slot_status.pop(slot, None)
        self._restarts.pop(slot, None)
        for rid in list(worker.holdings):  # a migration cut short by the timeout: give its blocks back
            tell(worker, Abort(rid))
        try:
            await call(worker.handle.shutdown.remote(), self.config.call_timeout_s)
        except Exception:  # noqa: BLE001 (dead or stuck: the kill below ends it anyway)
            pass
        ray.kill(worker.handle, no_restart=True)

    # ---- scaling --------------------------------------------------------------------------------
    async def scale(self, targets: dict, timeout_s: float | None = None) -> dict:
        """Bring each role named in `targets` to that many workers (see the module docstring)."""
        for role, count in targets.items():
            if role not in self.roles:
                raise InvalidRequest(f"this cluster's roles are {', '.join(self.roles)}, not {role!r}",
                                     param=role)
            if type(count) is not int or not 1 <= count <= MAX_WORKERS_PER_ROLE:
                raise InvalidRequest(f"'{role}' must be an integer in 1..{MAX_WORKERS_PER_ROLE}", param=role)
        if self._scaling:
            raise Conflict("a scale is already under way")
        self._scaling = True  # NOTE: cleared by the task itself: a client gone must not clear it early
        return await self._shielded(self._scale(targets, self._drain_timeout(timeout_s)))

    async def _scale(self, targets: dict, timeout_s: float) -> dict:
        try:
            return await self._scale_roles(targets, timeout_s)
        finally:
            self._scaling = False

    async def _scale_roles(self, targets: dict, timeout_s: float) -> dict:
        added, drained, errors = [], [], []
        for role in self.roles:  # NOTE: prefill joins first, so new decode workers handshake with it
            if role not in targets:
                continue
            staying = self._staying(role)
            more = targets[role] - len(staying)
            if more > 0:
                done = await asyncio.gather(*(self._add(role) for _ in range(more)), return_exceptions=True)
                added += [w for w in done if isinstance(w, str)]
                errors += [f"a new {role} worker did not join: {e}" for e in done if not isinstance(e, str)]
            elif more < 0:
                surplus = sorted(staying, key=lambda w: (len(self._needing(w)), w.name))[:-more]
                done = await asyncio.gather(*(self._drain(w, timeout_s) for w in surplus),
                                            return_exceptions=True)
                drained += [d for d in done if isinstance(d, dict)]
                errors += [f"drain failed: {e!r}" for e in done if not isinstance(e, dict)]
        result = {"added": added, "drained": drained, "errors": errors,
                  "workers": {role: sorted(w.name for w in self._staying(role)) for role in self.roles}}
        log.warning("scaled to %s", result["workers"])
        return result

    async def _add(self, role: str) -> str:
        """A new worker of `role` in a fresh slot; it joins routing after the same handshakes as a
        replacement. Returns its name; raises (and ends the actor) when it does not join."""
        import ray

        slot = self._fresh_slot(role)
        self._retired.add(slot)  # NOTE: reserved now so a concurrent add cannot take it; freed on join
        worker = spawn_worker(self.config, role, slot, self._pull.address, self.namespace, 0, self._kv_host(),
                              self._published, self.keys)
        self._joining[worker.name] = worker
        try:
            await self._join(worker)
        except BaseException:
            ray.kill(worker.handle, no_restart=True)
            raise
        finally:
            self._joining.pop(worker.name, None)
        self._retired.discard(slot)
        self.workers[worker.name] = worker
        log.warning("worker %s added", worker.name)
        return worker.name

    def _fresh_slot(self, role: str) -> str:
        """The first "<role>-<i>" never used by this cluster (retired slots are not reused: Ray may
        still hold the old actor's name for a moment)."""
        used = {w.slot or w.name for w in (*self.workers.values(), *self._joining.values())} | self._retired
        i = 0
        while f"{role}-{i}" in used:
            i += 1
        return f"{role}-{i}"
