"""Fault injection on the sending side of KV migration, for the chaos benchmark and tests.

A `Faults` object belongs to one prefill worker's senders. `arm(kind, count)` makes the next
`count` transfers each suffer one fault of `kind` (thread-safe: the worker's command thread arms,
its loop thread sends). Kinds: control faults on the manifest message (`drop_control`,
`dup_control`, `delay_control`), data faults on the payload chunks (`drop_data`, `dup_data`,
`delay_data`, `reorder_data`), and one-bit corruptions (`flip_payload`, `flip_manifest`).
Corrupting never touches pool memory: the flipped chunk is a copy. `injected` counts what was
actually applied (a reorder of a one-chunk payload is not), so a benchmark can check that every
injected corruption was detected by a receiver.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

from protocol.messages import TRANSFER_FAULTS as KINDS

DATA = ("drop_data", "dup_data", "delay_data", "reorder_data")


class Faults:
    """Armed faults of one sender pool, and how many of each were injected."""

    def __init__(self, delay_s: float = 0.2, seed: int = 0):
        self.delay_s = delay_s              # how long delay_* faults stall the message
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._armed: list[str] = []
        self.injected: Counter[str] = Counter()

    def arm(self, kind: str, count: int = 1) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown transfer fault {kind!r}; known: {', '.join(KINDS)}")
        with self._lock:
            self._armed += [kind] * count

    def take(self) -> str | None:
        """The fault the next transfer suffers (None: none armed)."""
        with self._lock:
            return self._armed.pop(0) if self._armed else None

    def _count(self, kind: str) -> None:
        with self._lock:
            self.injected[kind] += 1

    def corruptions(self) -> int:
        """One-bit flips injected so far (each must be detected by a receiver)."""
        with self._lock:
            return self.injected["flip_payload"] + self.injected["flip_manifest"]

    # ---- applying one fault ----------------------------------------------------------------------
    def manifest(self, kind: str | None, body: bytes) -> list[bytes]:
        """The manifest bodies to send for this transfer (none, one, two; maybe flipped)."""
        if kind == "drop_control":
            self._count(kind)
            return []
        if kind == "dup_control":
            self._count(kind)
            return [body, body]
        if kind == "delay_control":
            self._count(kind)
            time.sleep(self.delay_s)
        if kind == "flip_manifest":
            self._count(kind)
            return [self.flip(body)]
        return [body]

    def chunks(self, kind: str | None, chunks):
        """Transform an iterator of (key, view) payload pieces by this transfer's data fault."""
        if kind not in DATA and kind != "flip_payload":
            yield from chunks
            return
        items = list(chunks)
        if not items:
            yield from items
            return
        i = self._rng.randrange(len(items))
        if kind == "drop_data":
            del items[i]
        elif kind == "dup_data":
            items.insert(i, items[i])
        elif kind == "reorder_data":
            if len(items) < 2:
                yield from items
                return
            j = (i + 1) % len(items)
            items[i], items[j] = items[j], items[i]
        elif kind == "flip_payload":
            key, view = items[i]
            items[i] = (key, self.flip(view))
        self._count(kind)
        for n, item in enumerate(items):
            if kind == "delay_data" and n == i:
                time.sleep(self.delay_s)
            yield item

    def flip(self, buf) -> bytes:
        """A copy of `buf` with one random bit flipped."""
        data = bytearray(memoryview(buf).cast("B"))
        if data:
            pos = self._rng.randrange(len(data) * 8)
            data[pos // 8] ^= 1 << (pos % 8)
        return bytes(data)
