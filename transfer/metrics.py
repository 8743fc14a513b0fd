"""Counters for KV migration: completed transfers, bytes, deduplicated blocks and one counter
per error kind (keyed by `TransferError.code`). Thread-safe; `snapshot()` gives a plain dict
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

    def record_error(self, err: TransferError) -> None:
        with self._lock:
            self.errors[err.code] += 1

    def add(self, name: str, value: int = 1) -> None:
        with self._lock:
            self.counters[name] += value

    def snapshot(self) -> dict:
        with self._lock:
            return {"errors": dict(self.errors), "counters": dict(self.counters)}


DEFAULT_METRICS = TransferMetrics()
