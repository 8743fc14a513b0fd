"""Admission to decode workers, as a mixin of `ClusterBackend` (coordinator.cluster): before a
request is prefilled, a decode worker must reserve room for its migration. Waiting requests queue
in arrival order; only the first is woken when a decode worker reports, so a full cluster sees one
retry per report instead of every waiter polling every worker; beyond `max_waiting` waiters a new
request gets 429 with Retry-After at once.
"""

from __future__ import annotations

import asyncio
import time

from coordinator.bounded import bounded
from coordinator.completion_request import InvalidRequest, ServiceUnavailable, Timeout
from coordinator.guard import Overloaded
from coordinator.workers import CommandEncodeError, RequestState, actor_died, command, tell
from protocol.messages import Abort, Reserve


class AdmissionMixin:
    """Needs from the host class: config, workers, metrics, _requests, _lost, _loads, _waiters."""

    async def _reserve(self, request: RequestState, epoch: int) -> None:
        """Credit-based backpressure: a decode worker must admit the coming migration (request.decode
        first, then the others by free blocks). When all refuse, the request joins the FIFO of
        waiters (429 when `max_waiting` are already there) and tries again when a decode worker
        reports (only the first waiter is woken), up to reserve_wait_s, then 503. Each refusal is
        counted."""
        c, tokens = self.config, len(request.prompt) + len(request.generated) + 1
        deadline = time.monotonic() + c.reserve_wait_s
        while request.rid in self._requests:  # until dropped (client gone, aborted)
            loads = sorted((w for w in self._loads("decode")
                            if w.alive and w.worker_id not in self._lost | request.avoid),
                           key=lambda w: (w.worker_id != request.decode, -w.free_blocks))
            if not loads:
                raise ServiceUnavailable("no live decode worker")
            if all(request.n * (-(-tokens // w.block_size) + 1) > self.workers[w.worker_id].stats.get(
                    "total_blocks", 1 << 30) for w in loads):
                raise InvalidRequest(f"{request.n} x {tokens} tokens (+1 block each) exceed every decode "
                                     "worker's KV pool", param="prompt")
            for load in loads:
                worker = self.workers[load.worker_id]
                try:
                    reserve = Reserve(request.rid, epoch, tokens, request.n, request.prefill)
                    reply = await command(worker, reserve, c.call_timeout_s)
                except asyncio.TimeoutError:
                    raise Timeout(f"decode worker {worker.name} did not answer within {c.call_timeout_s}s") \
                        from None
                except CommandEncodeError as e:  # this request's fields, not the worker
                    raise InvalidRequest(f"the request cannot be encoded for the workers: {e}") from None
                except Exception as e:
                    if actor_died(e):  # Ray says it is gone: say so now, not a heartbeat later
                        worker.dead = type(e).__name__
                    continue  # either way, ask the next decode worker
                if reply.granted:
                    if request.rid not in self._requests:  # dropped while we waited: give the credit back
                        tell(worker, Abort(request.rid))
                        raise ServiceUnavailable("request aborted")
                    old, request.decode = self.workers.get(request.decode), worker.name
                    if old is not None and old.name != request.decode:  # an earlier attempt's credit there
                        tell(old, Abort(request.rid))
                    self._wake_first_waiter()  # room may be left for the next one in line
                    return
                self.metrics.count_backpressure(worker.name)
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServiceUnavailable(f"decode workers full: no room for the request within "
                                         f"{c.reserve_wait_s:g}s")
            await self._wait_in_line(min(left, 1.0))
        raise ServiceUnavailable("request aborted")

    async def _wait_in_line(self, timeout: float) -> None:
        """Wait for a decode worker's report (or `timeout`) behind the requests already waiting."""
        if len(self._waiters) >= self.config.max_waiting:
            raise Overloaded(f"{len(self._waiters)} requests already wait for decode room: retry shortly")
        turn = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        try:
            await bounded(turn, timeout)
        except asyncio.TimeoutError:  # no report woke it: look again anyway
            pass
        finally:
            if turn in self._waiters:
                self._waiters.remove(turn)

    def _wake_first_waiter(self) -> None:
        """A decode worker reported (or a reservation succeeded): the first waiter tries again."""
        while self._waiters:
            turn = self._waiters.popleft()
            if not turn.done():
                turn.set_result(None)
                return
