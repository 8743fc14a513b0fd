"""What the prefill role tracks per request between its prefill and the release of its blocks:
where its KV goes (`Target`), the migration running on a migration thread (`InFlightMigration`), and the one
object both the handler and the streamed migrations read and write (`Migrations`). Loop thread
only.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field


@dataclass
class Target:
    """Where a request's KV goes (the decode worker, its KV address, the migration epoch), and the
    engine's Request (kept: the engine retires a request that finished at its first token)."""

    decode_worker: str
    decode_address: str
    epoch: int
    request: object = None


@dataclass
class InFlightMigration:
    """A request whose migration runs on a migration thread; its blocks are freed when it returns.
    A streamed one starts while the request is still prefilling (request None until finalized)."""

    request: object
    cancelled: bool = False  # aborted or superseded meanwhile: free the blocks, report nothing
    feed: queue.SimpleQueue | None = None  # streamed: what the migration thread sends next
    sent: int = 0                          # streamed: logical blocks handed to the feed so far
    pinned: list = field(default_factory=list)  # streamed: blocks referenced until the result
    finalized: bool = False                # streamed: the final state went out

    def cancel(self) -> None:
        self.cancelled = True
        if self.feed is not None and not self.finalized:
            self.feed.put(None)


@dataclass
class Migrations:
    """The state `PrefillHandler` and `StreamedMigrations` share: a request enters `targets` when
    it is submitted (or resent) and `inflight` when its migration starts."""

    targets: dict[str, Target] = field(default_factory=dict)   # request id -> migration target
    # request id -> migration on a migration thread
    inflight: dict[str, InFlightMigration] = field(default_factory=dict)
