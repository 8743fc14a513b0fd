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
Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import logging

from coordinator.ledger import Phase
from coordinator.protocol import APIError, ServiceUnavailable
from coordinator.router import NoWorkerError
from coordinator.workers import call as _call

log = logging.getLogger(__name__)


class FailoverMixin:
    """Needs from the host class: config, workers, routers, ledger, metrics, _reqs, _lost, _loads,
    _dispatch, _reserve, _drop, _spawn (see coordinator.cluster.ClusterBackend)."""

    async def _retry_prefill(self, st, lost: str) -> None:
        """The prefill worker died before migrating: rerun the prompt on another one (new epoch).
        Tokens it already sent are not repeated: events are placed by output position."""
        try:
            st.prefill = self.routers["prefill"].pick(self._loads("prefill"), "prefill", st.prompt,
                                                      exclude={lost})
            self.metrics.count_retry("prefill")
            log.warning("request %s: prefill worker %s lost, rerunning on %s", st.rid, lost, st.prefill)
            await self._dispatch(st)
        except (NoWorkerError, APIError) as e:
            if st.rid in self._reqs:
                self._drop(st, ok=False)
                st.q.put_nowait(e if isinstance(e, APIError) else ServiceUnavailable(
                    f"prefill worker {lost} stopped responding and no other is live"))

    async def _resend(self, st, bad: str, why: str) -> None:
        """The migration to decode worker `bad` failed and the prefill worker holds the blocks: reserve
        on another decode worker under a new epoch and have the prefill worker send them there."""
        if st.rid not in self._reqs:  # dropped meanwhile: the abort released the held blocks
            return
        st.resending = True
        try:
            st.avoid.add(bad)
            # the prefill worker keeps owning the blocks: a new ownership epoch, the migration's after it
            epoch = st.epoch = self.ledger.move(st.rid, Phase.PREFILLING, st.prefill) + 1
            try:
                await self._reserve(st, epoch)  # switches st.decode (and frees the credit on `bad`)
            except APIError as e:
                if st.rid in self._reqs:
                    self._drop(st, ok=False)  # aborts on the prefill worker: the held blocks go back
                    st.q.put_nowait(ServiceUnavailable(f"{why}; no other decode worker could take the "
                                                       f"held KV: {e.message}"))
                return
            d = self.workers[st.decode]
            try:
                err = await _call(self.workers[st.prefill].handle.resend.remote(st.rid, d.name, d.address,
                                                                                epoch),
                                  self.config.call_timeout_s)
            except Exception as e:  # the prefill worker died or stalled: the monitor reruns the prefill
                err = f"resend call failed: {type(e).__name__}"
            if st.rid not in self._reqs:
                return
            st.resumed += 1
            if err:  # no longer held there (released, expired): prefill again instead
                log.warning("request %s: %s; re-prefilling", st.rid, err)
                st.resending = False
                self._resume(st, bad, f"{why}; {err}")
                return
            st.resent += 1
            self.metrics.count_retry("resend")
            log.warning("request %s: %s; re-sending the held KV from %s to %s", st.rid, why, st.prefill,
                        st.decode)
        finally:
            st.resending = False

    def _resume(self, st, bad: str, why: str) -> None:
        """The decode worker `bad` died or a migration to it failed: prefill again (n=1: prompt +
        the tokens streamed so far, sampling continuing at their count; n>1: from the start) and
        continue on another decode worker. Positions already sent are never sent twice (the
        reorder drops them). Workers are picked now, so a second trigger sees the new owner."""
        try:
            st.decode = self.routers["decode"].pick(self._loads("decode"), "decode",
                                                    exclude=self._lost | {bad})
            st.generated = list(st.tokens[0]) if st.n == 1 else []
            st.prefill = self.routers["prefill"].pick(self._loads("prefill"), "prefill",
                                                      st.prompt + st.generated, exclude=self._lost)
        except NoWorkerError:
            self._drop(st, ok=False)
            st.q.put_nowait(ServiceUnavailable(f"{why}; no other live decode/prefill worker to continue on"))
            return
        st.avoid.add(bad)
        old = self.workers.get(bad)
        if old is not None:  # release whatever it still holds for the request (credit, sequences)
            old.handle.abort.remote(st.rid)
        st.resumed += 1
        st.migration, st.decoded = None, False
        self.metrics.count_retry("decode")
        log.warning("request %s: %s; resuming after %d tokens via %s -> %s", st.rid, why,
                    len(st.generated), st.prefill, st.decode)
        self._spawn(self._redispatch(st))

    async def _redispatch(self, st) -> None:
        try:
            await self._dispatch(st)
        except APIError as e:
            if st.rid in self._reqs:
                self._drop(st, ok=False)
                st.q.put_nowait(e)

    async def _monitor(self) -> None:
        """Act, at once, on the requests of a worker whose heartbeat stopped (see the module doc)."""
        while True:
            await asyncio.sleep(self.config.monitor_s)
            for w in self.workers.values():
                if w.alive(self.config.heartbeat_timeout_s):
                    self._lost.discard(w.name)
                    continue
                if w.name in self._lost:
                    continue
                self._lost.add(w.name)
                log.warning("worker %s is gone (no heartbeat for %.1fs)", w.name,
                            self.config.heartbeat_timeout_s)
                self.routers[w.role].forget(w.name)
                for st in list(self._reqs.values()):
                    self._on_lost(w, st)

    def _on_lost(self, w, st) -> None:
        if w.role == "colocated":
            if st.decode == w.name:
                self.metrics.count_error("worker_lost")
                self._drop(st, ok=False)
                st.q.put_nowait(ServiceUnavailable(f"colocated worker {w.name} stopped responding; "
                                                   f"the request was lost"))
            return
        unmigrated = st.migration is None and not st.decoded
        on_prefill = st.prefill == w.name and unmigrated
        if on_prefill and st.decode not in self._lost:
            self._spawn(self._retry_prefill(st, w.name))
        elif st.decode == w.name and not all(st.done):
            if st.resending or (unmigrated and st.prefill not in self._lost):
                return  # the prefill worker's migration to it fails and its held blocks are re-sent
            self._resume(st, w.name, f"decode worker {w.name} stopped responding")
        elif on_prefill:
            self.metrics.count_error("worker_lost")
            self._drop(st, ok=False)
            st.q.put_nowait(ServiceUnavailable(f"{w.role} worker {w.name} stopped responding; "
                                               f"the request was lost"))
