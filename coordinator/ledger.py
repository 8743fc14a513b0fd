"""Ownership ledger: which workers hold each request's KV blocks, in which phase, at which epoch.

Every move of ownership (queued -> prefilling on a prefill worker -> migrating -> decoding on a
decode worker -> finished/failed, or a retry on another worker) bumps the request's epoch;
transfers carry the epoch they were issued under and decode workers refuse any other. The
blocks come from the workers themselves: each `WorkerReport` says how many blocks the worker
holds per request, and `record` writes them down, so while requests run the ledger's
`owned_blocks()` per worker equals that worker's used blocks (coordinator.reconcile compares
the two on every report).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
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
    """One request. owner: the worker responsible in this phase (prefill worker while
    prefilling, decode worker from migrating on). blocks: worker -> blocks it reports holding."""

    request_id: str
    phase: Phase = Phase.QUEUED
    owner: str | None = None
    epoch: int = 0
    blocks: dict[str, int] = field(default_factory=dict)
    history: list[tuple[float, str, str | None, int]] = field(default_factory=list)


class Ledger:
    def __init__(self, keep_finished: int = 1024, clock: Callable[[], float] = time.time):
        """clock: what each history entry is stamped with (a simulator passes its virtual clock)."""
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._done: list[str] = []
        self._keep = keep_finished
        self.counts = {p.value: 0 for p in TERMINAL}

    def open(self, request_id: str) -> Entry:
        with self._lock:
            if request_id in self._entries:
                raise LedgerError(f"request {request_id!r} is already in the ledger")
            entry = Entry(request_id)
            entry.history.append((self._clock(), entry.phase.value, None, 0))
            self._entries[request_id] = entry
            return entry

    def move(self, request_id: str, phase: Phase, owner: str | None) -> int:
        """Record a phase change; returns the new epoch (bumped on every move)."""
        with self._lock:
            entry = self._get(request_id)
            if entry.phase in TERMINAL:
                raise LedgerError(f"request {request_id!r} is {entry.phase.value}; "
                                  f"it cannot move to {phase.value}")
            entry.phase, entry.owner = phase, owner
            entry.epoch += 1
            entry.history.append((self._clock(), phase.value, owner, entry.epoch))
            if phase in TERMINAL:
                self.counts[phase.value] += 1
                entry.blocks.clear()
                self._done.append(request_id)
                while len(self._done) > self._keep:
                    self._entries.pop(self._done.pop(0), None)
            return entry.epoch

    def close(self, request_id: str, ok: bool) -> None:
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.phase in TERMINAL:
                return
        self.move(request_id, Phase.FINISHED if ok else Phase.FAILED, None)

    def record(self, worker: str, holdings: dict[str, int]) -> None:
        """A worker's report: the blocks it holds per request (requests it does not list: none)."""
        with self._lock:
            for entry in self._entries.values():
                if entry.phase in TERMINAL:
                    continue
                held = holdings.get(entry.request_id)
                if held is None:
                    entry.blocks.pop(worker, None)
                else:
                    entry.blocks[worker] = int(held)

    def forget_worker(self, worker: str) -> None:
        """A dead worker holds nothing any more."""
        self.record(worker, {})

    def get(self, request_id: str) -> Entry | None:
        with self._lock:
            return self._entries.get(request_id)

    def _get(self, request_id: str) -> Entry:
        entry = self._entries.get(request_id)
        if entry is None:
            raise LedgerError(f"unknown request {request_id!r}")
        return entry

    def active(self) -> list[Entry]:
        with self._lock:
            return [e for e in self._entries.values() if e.phase not in TERMINAL]

    def owned_blocks(self) -> dict[str, int]:
        """Blocks each worker holds for live requests, as last reported."""
        out: dict[str, int] = {}
        for entry in self.active():
            for worker, blocks in entry.blocks.items():
                out[worker] = out.get(worker, 0) + blocks
        return out

    def summary(self) -> dict:
        active = self.active()
        by_phase: dict[str, int] = {}
        for entry in active:
            by_phase[entry.phase.value] = by_phase.get(entry.phase.value, 0) + 1
        owned = self.owned_blocks()
        return {"active_requests": len(active), "owned_blocks": sum(owned.values()),
                "owned_blocks_by_worker": owned, "by_phase": by_phase,
                "finished": self.counts["finished"], "failed": self.counts["failed"]}
