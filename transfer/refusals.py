"""What a KV receiver does with input from a peer that has not completed an authenticated
handshake (ARCHITECTURE.md, convention 15): it costs at most `PREAUTH_MAX_BYTES`, is size-checked
before it is decoded, and anything it causes, an exception of any type included, is a refusal.
A refusal is counted by reason in the receiver's `TransferMetrics.refusals` (a decode worker's
stats show them as `kv_refusals`), answered at most with a detail-free nack, never raised into
the receiver's loop, and logged at a bounded rate: at most one line per reason per
`interval_s`, which says how many more were suppressed since the last line.
"""

from __future__ import annotations

import logging
import threading
import time

from transfer.errors import LimitExceeded, MalformedMessage, TransferError

log = logging.getLogger("transfer.refusals")

PREAUTH_MAX_BYTES = 8 << 10  # a hello (or anything sent before one succeeded) is at most this


class Refusals:
    """Counts and rate-limited logging of one receiver's refusals; thread-safe."""

    def __init__(self, metrics, where: str = "", interval_s: float = 10.0, logger=log):
        self.metrics, self.where, self.interval_s, self.log = metrics, where, interval_s, logger
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}      # reason -> when its last line was logged
        self._suppressed: dict[str, int] = {}  # reason -> refusals since then, not logged

    def refuse(self, reason: str, detail: str = "") -> None:
        self.metrics.record_refusal(reason)
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(reason, -1e18) < self.interval_s:
                self._suppressed[reason] = self._suppressed.get(reason, 0) + 1
                return
            self._last[reason] = now
            more = self._suppressed.pop(reason, 0)
        self.log.warning("%sKV refusal (%s): %s%s", f"{self.where}: " if self.where else "", reason,
                         detail[:200], f" (+{more} more since the last line)" if more else "")


def as_refusal(exc: BaseException) -> TransferError:
    """Any exception raised while handling unauthenticated input, as a typed error to refuse with
    (its type named, its text not echoed)."""
    if isinstance(exc, TransferError):
        return exc
    return MalformedMessage(f"refused: {type(exc).__name__} while checking it")


def too_big(nbytes: int, what: str) -> TransferError | None:
    """The refusal of an unauthenticated message of `nbytes`, or None when it is small enough."""
    if nbytes > PREAUTH_MAX_BYTES:
        return LimitExceeded(f"{what} of {nbytes} bytes before a completed handshake "
                             f"(at most {PREAUTH_MAX_BYTES})")
    return None
