"""Counters for KV migration: completed transfers, bytes, deduplicated blocks, one counter per
error kind (keyed by `TransferError.code`) and one per reason a receiver refused an
unauthenticated peer (`transfer.refusals`). Thread-safe; `snapshot()` gives a plain dict
that a worker can export (e.g. as Prometheus counters).
"""

from __future__ import annotations

import threading
from collections import Counter

from transfer.errors import TransferError


class TransferMetrics:
    """One instance per endpoint (sender or receiver); pass it down explicitly."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.errors: Counter[str] = Counter()
        self.counters: Counter[str] = Counter()
        self.refusals: Counter[str] = Counter()

    def record_error(self, err: TransferError) -> None:
        with self._lock:
            self.errors[err.code] += 1

    def record_refusal(self, reason: str) -> None:
        with self._lock:
            self.refusals[reason] += 1

    def add(self, name: str, value: int = 1) -> None:
        with self._lock:
            self.counters[name] += value

    def snapshot(self) -> dict:
        with self._lock:
            return {"errors": dict(self.errors), "counters": dict(self.counters),
                    "refusals": dict(self.refusals)}


DEFAULT_METRICS = TransferMetrics()
