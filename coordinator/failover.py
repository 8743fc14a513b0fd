"""Failure handling of the disaggregated cluster, as a mixin of `ClusterBackend` (coordinator.cluster).

- a prefill worker lost before migrating: the request is rerun on another prefill worker;
- a migration to a decode worker failed (timeout, transport error, the decode worker wedged or
  died mid-transfer) while the prefill worker still holds the request's blocks: the coordinator
  reserves room on another decode worker, bumps the ledger epoch (the blocks are still owned by
  the prefill worker) and asks the prefill worker to `resend` the same blocks there under the new
  epoch: no re-prefill (`_resend`, counted as retries{phase="resend"} and in the request's
  `resent`). When no decode worker can take it within `reserve_wait_s`, the request fails with
  503 and the prefill worker releases the blocks (abort); the prefill worker also releases them
  by itself after its `hold_s`;
- a decode worker lost mid-decode (or a migration failure without held blocks): prefill again
  with prompt + tokens streamed so far and continue on another decode worker (`_resume`);
- a decode worker lost while a request has not migrated yet and its prefill worker is alive:
  nothing is done at once, since the prefill worker's migration to it times out (its transfer
  timeout is below the heartbeat timeout) and reports held blocks, which are then re-sent;
- colocated workers: their requests fail with 503 at once.
Every lost worker is then replaced (coordinator.lifecycle). Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import logging

from coordinator.completion_request import APIError, ServiceUnavailable
from coordinator.ledger import Phase
from coordinator.router import NoWorkerError
from coordinator.workers import command, tell
from protocol.messages import Abort, Resend

log = logging.getLogger(__name__)


class FailoverMixin:
    """Needs from the host class: config, workers, routers, ledger, reconciler, metrics, _requests,
    _lost, _loads, _dispatch, _reserve, _drop, _spawn (see coordinator.cluster.ClusterBackend)."""

    async def _retry_prefill(self, request, lost: str) -> None:
        """The prefill worker died before migrating: rerun the prompt on another one (new epoch).
        Tokens it already sent are not repeated: events are placed by output position."""
        try:
            request.prefill = self.routers["prefill"].pick(self._loads("prefill"), "prefill", request.prompt,
                                                      exclude={lost})
            self.metrics.count_retry("prefill")
            log.warning("request %s: prefill worker %s lost, rerunning on %s", request.rid, lost,
                        request.prefill)
            await self._dispatch(request)
        except (NoWorkerError, APIError) as e:
            if request.rid in self._requests:
                self._drop(request, ok=False)
                request.q.put_nowait(e if isinstance(e, APIError) else ServiceUnavailable(
                    f"prefill worker {lost} stopped responding and no other is live"))

    async def _resend(self, request, bad: str, why: str) -> None:
        """The migration to decode worker `bad` failed and the prefill worker holds the blocks: reserve
        on another decode worker under a new epoch and have the prefill worker send them there."""
        if request.rid not in self._requests:  # dropped meanwhile: the abort released the held blocks
            return
        request.resending = True
        try:
            request.avoid.add(bad)
            # the prefill worker keeps owning the blocks: a new ownership epoch, the migration's after it
            epoch = request.epoch = self.ledger.move(request.rid, Phase.PREFILLING, request.prefill) + 1
            try:
                await self._reserve(request, epoch)  # switches request.decode (and frees the credit on `bad`)
            except APIError as e:
                if request.rid in self._requests:
                    self._drop(request, ok=False)  # aborts on the prefill worker: the held blocks go back
                    request.q.put_nowait(ServiceUnavailable(f"{why}; no other decode worker could take "
                                                            f"the held KV: {e.message}"))
                return
            d = self.workers[request.decode]
            try:
                resend = Resend(request.rid, d.name, d.address, epoch)
                reply = await command(self.workers[request.prefill], resend,
                                      self.config.call_timeout_s)
                err = reply.error
            except Exception as e:  # the prefill worker died or stalled: the monitor reruns the prefill
                err = f"resend call failed: {type(e).__name__}"
            if request.rid not in self._requests:
                return
            request.resumed += 1
            if err:  # no longer held there (released, expired): prefill again instead
                log.warning("request %s: %s; re-prefilling", request.rid, err)
                request.resending = False
                self._resume(request, bad, f"{why}; {err}")
                return
            request.resent += 1
            self.metrics.count_retry("resend")
            log.warning("request %s: %s; re-sending the held KV from %s to %s", request.rid, why,
                        request.prefill,
                        request.decode)
        finally:
            request.resending = False

    def _resume(self, request, bad: str, why: str) -> None:
        """The decode worker `bad` died or a migration to it failed: prefill again (n=1: prompt +
        the tokens streamed so far, sampling continuing at their count; n>1: from the start) and
        continue on another decode worker. Positions already sent are never sent twice (the
        reorder drops them). Workers are picked now, so a second trigger sees the new owner."""
        try:
            request.decode = self.routers["decode"].pick(self._loads("decode"), "decode",
                                                    exclude=self._lost | {bad})
            request.generated = list(request.tokens[0]) if request.n == 1 else []
            request.prefill = self.routers["prefill"].pick(self._loads("prefill"), "prefill",
                                                      request.prompt + request.generated, exclude=self._lost)
        except NoWorkerError:
            self._drop(request, ok=False)
            request.q.put_nowait(ServiceUnavailable(f"{why}; no other live decode/prefill worker to "
                                                    "continue on"))
            return
        request.avoid.add(bad)
        old = self.workers.get(bad)
        if old is not None:  # release whatever it still holds for the request (credit, sequences)
            tell(old, Abort(request.rid))
        request.resumed += 1
        request.migration, request.decoded = None, False
        self.metrics.count_retry("decode")
        log.warning("request %s: %s; resuming after %d tokens via %s -> %s", request.rid, why,
                    len(request.generated), request.prefill, request.decode)
        self._spawn(self._redispatch(request))

    async def _redispatch(self, request) -> None:
        try:
            await self._dispatch(request)
        except APIError as e:
            if request.rid in self._requests:
                self._drop(request, ok=False)
                request.q.put_nowait(e)

    async def _monitor(self) -> None:
        """Act, at once, on the requests of a worker whose heartbeat stopped (see the module doc)."""
        while True:
            await asyncio.sleep(self.config.monitor_s)
            for worker in list(self.workers.values()):
                why = worker.why_not_alive(self.config.heartbeat_timeout_s)
                if why is None:
                    self._lost.discard(worker.name)
                    continue
                if worker.name in self._lost:
                    continue
                self._lost.add(worker.name)
                self.ledger.forget_worker(worker.name)  # a dead worker holds nothing
                self.reconciler.forget_worker(worker.name)
                log.warning("worker %s is gone: %s", worker.name, why)
                self.routers[worker.role].forget(worker.name)
                for request in list(self._requests.values()):
                    self._on_lost(worker, request)
                self._spawn(self._replace(worker))  # coordinator.lifecycle: backoff, then a new worker

    def _on_lost(self, worker, request) -> None:
        if worker.role == "colocated":
            if request.decode == worker.name:
                self.metrics.count_error("worker_lost")
                self._drop(request, ok=False)
                request.q.put_nowait(ServiceUnavailable(f"colocated worker {worker.name} stopped responding; "
                                                   f"the request was lost"))
            return
        unmigrated = request.migration is None and not request.decoded
        on_prefill = request.prefill == worker.name and unmigrated
        if on_prefill and request.decode not in self._lost:
            self._spawn(self._retry_prefill(request, worker.name))
        elif request.decode == worker.name and not all(request.done):
            if request.resending or (unmigrated and request.prefill not in self._lost):
                return  # the prefill worker's migration to it fails and its held blocks are re-sent
            self._resume(request, worker.name, f"decode worker {worker.name} stopped responding")
        elif on_prefill:
            self.metrics.count_error("worker_lost")
            self._drop(request, ok=False)
            request.q.put_nowait(ServiceUnavailable(f"{worker.role} worker {worker.name} stopped responding; "
                                               f"the request was lost"))
