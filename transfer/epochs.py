"""Receiver-side epoch guard: a transfer for a request is accepted only if its epoch is newer
than every epoch already committed for that request, and no other transfer of that request is
in flight. A failed import does not count as seen (nothing was committed), so the sender may
retry it. Memory is bounded: beyond `capacity` request ids the least recently committed is
forgotten (epochs may be per-request counters, so no global floor is kept); a live sequence is
still protected by the receiver's refusal to import over an existing sequence id.
"""

from __future__ import annotations

from collections import OrderedDict

from transfer.errors import StaleEpoch


class EpochGuard:
    def __init__(self, capacity: int = 100_000):
        self.capacity = capacity
        self._committed: OrderedDict[str, int] = OrderedDict()
        self._in_flight: dict[str, int] = {}

    def begin(self, request_id: str, epoch: int) -> None:
        """Claim (request, epoch) for an import; StaleEpoch if it is stale, seen or busy."""
        last = self._committed.get(request_id)
        if last is not None and epoch <= last:
            raise StaleEpoch(f"request {request_id!r}: epoch {epoch} is not newer than committed {last}")
        if request_id in self._in_flight:
            raise StaleEpoch(f"request {request_id!r}: epoch {self._in_flight[request_id]} is in flight")
        self._in_flight[request_id] = epoch

    def commit(self, request_id: str, epoch: int) -> None:
        self._in_flight.pop(request_id, None)
        self._committed[request_id] = epoch
        self._committed.move_to_end(request_id)
        while len(self._committed) > self.capacity:
            self._committed.popitem(last=False)

    def abort(self, request_id: str, epoch: int) -> None:
        if self._in_flight.get(request_id) == epoch:
            del self._in_flight[request_id]
