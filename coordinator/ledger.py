"""Ownership ledger: which worker owns each request's KV blocks, in which phase, at which epoch.

Every move of ownership (queued -> prefilling on a prefill worker -> migrating -> decoding on a
decode worker -> finished/failed, or a retry on another worker) bumps the request's epoch.
Transfers carry the epoch they were issued under; `is_current` tells a worker whether to commit,
so a late, duplicate or stale transfer is refused instead of touching a live sequence. At rest
(no request active) every worker's used blocks, prefix-cache entries aside, must reconcile with
`owned_blocks()`: `reconcile` reports any difference.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field


class Phase(enum.Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    MIGRATING = "migrating"
    DECODING = "decoding"
    FINISHED = "finished"
    FAILED = "failed"


TERMINAL = (Phase.FINISHED, Phase.FAILED)


class LedgerError(RuntimeError):
    """An illegal move (unknown request, move out of a terminal phase): a coordinator bug."""


@dataclass
class Entry:
    request_id: str
    phase: Phase = Phase.QUEUED
    owner: str | None = None
    epoch: int = 0
    blocks: int = 0                       # blocks the owner holds for it (reported by workers)
    history: list[tuple[float, str, str | None, int]] = field(default_factory=list)


class Ledger:
    def __init__(self, keep_finished: int = 1024):
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._done: list[str] = []
        self._keep = keep_finished
        self.counts = {p.value: 0 for p in TERMINAL}

    def open(self, request_id: str) -> Entry:
        with self._lock:
            if request_id in self._entries:
                raise LedgerError(f"request {request_id!r} is already in the ledger")
            e = Entry(request_id)
            e.history.append((time.time(), e.phase.value, None, 0))
            self._entries[request_id] = e
            return e

    def move(self, request_id: str, phase: Phase, owner: str | None, blocks: int = 0) -> int:
        """Record a phase change; returns the new epoch (bumped on every move)."""
        with self._lock:
            e = self._get(request_id)
            if e.phase in TERMINAL:
                raise LedgerError(f"request {request_id!r} is {e.phase.value}; "
                                  f"it cannot move to {phase.value}")
            e.phase, e.owner, e.blocks = phase, owner, blocks
            e.epoch += 1
            e.history.append((time.time(), phase.value, owner, e.epoch))
            if phase in TERMINAL:
                self.counts[phase.value] += 1
                e.blocks = 0
                self._done.append(request_id)
                while len(self._done) > self._keep:
                    self._entries.pop(self._done.pop(0), None)
            return e.epoch

    def close(self, request_id: str, ok: bool) -> None:
        with self._lock:
            e = self._entries.get(request_id)
            if e is None or e.phase in TERMINAL:
                return
        self.move(request_id, Phase.FINISHED if ok else Phase.FAILED, None)

    def is_current(self, request_id: str, epoch: int) -> bool:
        with self._lock:
            e = self._entries.get(request_id)
            return e is not None and e.phase not in TERMINAL and e.epoch == epoch

    def get(self, request_id: str) -> Entry | None:
        with self._lock:
            return self._entries.get(request_id)

    def _get(self, request_id: str) -> Entry:
        e = self._entries.get(request_id)
        if e is None:
            raise LedgerError(f"unknown request {request_id!r}")
        return e

    def active(self) -> list[Entry]:
        with self._lock:
            return [e for e in self._entries.values() if e.phase not in TERMINAL]

    def owned_blocks(self) -> dict[str, int]:
        """Blocks each worker holds for live requests, as last reported."""
        out: dict[str, int] = {}
        for e in self.active():
            if e.owner is not None:
                out[e.owner] = out.get(e.owner, 0) + e.blocks
        return out

    def reconcile(self, used_by_worker: dict[str, int]) -> dict[str, tuple[int, int]]:
        """Workers whose used blocks differ from the ledger: worker -> (ledger, worker)."""
        owned = self.owned_blocks()
        return {w: (owned.get(w, 0), n) for w, n in used_by_worker.items() if owned.get(w, 0) != n}

    def summary(self) -> dict:
        act = self.active()
        by_phase: dict[str, int] = {}
        for e in act:
            by_phase[e.phase.value] = by_phase.get(e.phase.value, 0) + 1
        return {"active_requests": len(act), "owned_blocks": sum(self.owned_blocks().values()),
                "owned_blocks_by_worker": self.owned_blocks(), "by_phase": by_phase,
                "finished": self.counts["finished"], "failed": self.counts["failed"]}
