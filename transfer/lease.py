"""Sender-side leases: exported sequences whose blocks stay referenced until the receiver acks
(the transport releases them) or the lease expires (`expire`, called from the owner's loop).
`extra_refs` feeds `KVCacheManager.check_integrity(extra_refs=...)` so audits account for them.
"""

from __future__ import annotations

import time

from transfer.export import ExportedSequence


class LeaseTable:
    def __init__(self) -> None:
        self._leases: dict[tuple[str, int], ExportedSequence] = {}

    def add(self, exported: ExportedSequence) -> None:
        m = exported.manifest
        self._leases[(m.request_id, m.epoch)] = exported

    def release(self, request_id: str, epoch: int) -> bool:
        """Release one lease now (on ack); False if it is unknown or already gone."""
        e = self._leases.pop((request_id, epoch), None)
        if e is None:
            return False
        e.release()
        return True

    def expire(self, now: float | None = None) -> list[tuple[str, int]]:
        """Release every lease past its deadline (and forget released ones); returns the expired."""
        now = time.monotonic() if now is None else now
        out = []
        for key, e in list(self._leases.items()):
            if e.released:
                del self._leases[key]
            elif now >= e.deadline:
                e.release()
                del self._leases[key]
                out.append(key)
        return out

    def extra_refs(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for e in self._leases.values():
            for b, c in e.extra_refs().items():
                out[b] = out.get(b, 0) + c
        return out

    def __len__(self) -> int:
        return len(self._leases)
