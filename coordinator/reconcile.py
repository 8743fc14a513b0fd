"""Continuous reconciliation of the ledger against what each worker reports holding.

On every `WorkerReport` the coordinator records the worker's holdings in the ledger and asks
`Reconciler.check` what disagrees. Three kinds of discrepancy, each counted once it has outlived
`grace_s` and `MIN_REPORTS` consecutive reports of that worker (a report can race a command still
queued on the worker, and a worker whose loop was busy for seconds, e.g. migrating, reports the
queued command only in its next reports, so neither time nor one report alone is enough):
- `orphan`: the worker holds blocks for a request that is not live, or not assigned to it:
  repaired by aborting the request on that worker (its blocks are freed);
- `vanished`: the ledger says the worker is responsible for a live request (prefilling on it,
  or decoding on it), the worker listed it under the request's current epoch, and lists it no
  more: the request is failed loudly. A request the worker has not listed yet has not vanished:
  its command may still wait in the worker's actor queue (Ray delivers it behind slower calls,
  seconds late on a loaded machine) or in the loop's queue behind a long step, and the
  coordinator's event timeout bounds a command that never arrives. Only the attempt that made the
  request this worker's counts: reports carry no epoch, so once the request moved to a newer epoch
  on the same worker (a rerun, a resend), a listing may be the older attempt's - still held, or
  in a report sent before the move that arrives late - and that attempt ending is no vanishing of
  the new one (the simulation, dst, found a request failed so while its rerun ran fine,
  2026-12-06); a rerun on the same worker is bounded by the event timeout instead. Nor has
  a request whose every token has arrived (`generated`): its worker finished it and freed its
  blocks, and the coordinator waits only for the prefill worker's report of the migration (a busy
  prefill worker sends it seconds later on a loaded machine; counting it vanished failed a request
  that was answered right, 2026-12-03);
- `unowned`: the worker's used blocks exceed what its requests account for (a leak inside the
  worker): counted and logged; only the worker can free them.
"""

from __future__ import annotations

import logging
import time

from coordinator.ledger import Ledger, Phase

log = logging.getLogger(__name__)
MIN_REPORTS = 3
RESPONSIBLE = {"prefill": (Phase.PREFILLING, Phase.DECODING), "decode": (Phase.DECODING,)}


def _first_epoch(entry, worker: str, role: str) -> int | None:
    """The epoch of the move that first made `worker` responsible for the request (its history)."""
    phases = RESPONSIBLE.get(role, (Phase.DECODING,))
    return next((epoch for _, phase, owner, epoch in entry.history
                 if owner == worker and Phase(phase) in phases), None)


class Reconciler:
    def __init__(self, ledger: Ledger, grace_s: float, count):
        """count(kind): called once per discrepancy that outlived grace_s."""
        self.ledger, self.grace_s, self.count = ledger, grace_s, count
        self._since: dict[tuple[str, str, str], list] = {}  # (kind, worker, request) -> [first seen, reports]
        self._listed: dict[tuple[str, str], int] = {}  # (worker, request) -> epoch it was last listed under

    def check(self, worker: str, role: str, stats: dict, holdings: dict[str, int],
              assigned: dict[str, set[str]], generated: frozenset[str] = frozenset(),
              now: float | None = None) -> tuple[list[str], list[str]]:
        """assigned: live request id -> the workers it currently runs on; generated: live requests
        whose every token has arrived; now: the report's time (time.monotonic() when not given).
        Returns the requests to abort on `worker` (orphans) and the requests to fail (their blocks
        vanished)."""
        now, seen = time.monotonic() if now is None else now, set()
        orphans = [rid for rid in holdings if worker not in assigned.get(rid, ())]
        vanished, live = [], set()
        for entry in self.ledger.active():
            key = (worker, entry.request_id)
            live.add(key)
            responsible = entry.owner == worker and (
                entry.phase is Phase.DECODING or (entry.phase is Phase.PREFILLING and role == "prefill"))
            if not responsible or entry.request_id in generated:
                continue
            if entry.request_id in holdings:
                if _first_epoch(entry, worker, role) == entry.epoch:  # else it may list an older attempt
                    self._listed[key] = entry.epoch
            elif self._listed.get(key) == entry.epoch:
                vanished.append(entry.request_id)
        for key in [k for k in self._listed if k[0] == worker and k not in live]:
            del self._listed[key]  # finished or failed: nothing left to vanish
        unowned = int(stats.get("used_blocks", 0)) - sum(holdings.values())
        found = [("orphan", rid) for rid in orphans] + [("vanished", rid) for rid in vanished]
        if unowned > 0:
            found.append(("unowned", ""))
        due: dict[str, list[str]] = {"orphan": [], "vanished": [], "unowned": []}
        for kind, rid in found:
            key = (kind, worker, rid)
            seen.add(key)
            seen_since = self._since.setdefault(key, [now, 0])
            seen_since[1] += 1
            if now - seen_since[0] > self.grace_s and seen_since[1] >= MIN_REPORTS:
                due[kind].append(rid)
                del self._since[key]  # counted once; a repair that does not take is counted again
        for key in [k for k in self._since if k[1] == worker and k not in seen]:
            del self._since[key]  # it resolved itself within the grace
        for kind, rids in due.items():
            for rid in rids:
                self.count(kind)
                log.warning("ledger discrepancy on %s: %s %s (used %s, held %s)", worker, kind, rid or "",
                            stats.get("used_blocks"), sum(holdings.values()))
        return due["orphan"], due["vanished"]

    def forget_worker(self, worker: str) -> None:
        for key in [k for k in self._since if k[1] == worker]:
            del self._since[key]
        for key in [k for k in self._listed if k[0] == worker]:
            del self._listed[key]
