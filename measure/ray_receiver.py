"""A Ray actor body that receives KV migrations into its own synthetic pool, for the migration
benchmark and the Ray transport tests: `ray.remote(PoolReceiver).remote(layout_args,
num_blocks)`. It is the runtime's `RayReceiverEndpoint` (so its channel calls, `kv(conn,
headers, *bodies)`, are answered exactly as a decode worker answers them) over a pool from
`measure.pools`, plus a few calls the benchmark and tests need: the canonical digest of an
imported sequence, freeing it (scrubbed, so a later transfer must rewrite the blocks, and
uncached), warming the object store's mappings, and pool statistics.
"""

from __future__ import annotations

import contextlib

import torch

from kvcache.storage import KVLayout
from measure.pools import kv_digest, make_manager, scrub_blocks
from transfer.channels.ray_receiver import RayReceiverEndpoint
from transfer.errors import TransferError
from transfer.metrics import TransferMetrics
from transfer.transport import TransportConfig


def release_import(manager, seq_id) -> None:
    """Scrub the blocks only this sequence holds, then free it and drop them from the prefix
    cache (a zeroed block must not stay cached under its hash), so a later transfer must really
    rewrite them. The benchmark's ZeroMQ peer (`measure.migrate_peer`) releases imports this way too."""
    scrub_blocks(manager, [b for b in manager.table(seq_id).blocks if manager.allocator.ref_count(b) == 1])
    manager.free(seq_id, uncache=True)


class PoolReceiver(RayReceiverEndpoint):
    """Actor body with its own synthetic pool: `ray.remote(PoolReceiver).remote(...)`."""

    def __init__(self, layout_args: tuple, num_blocks: int, config: TransportConfig | None = None,
                 prefault: bool = False):
        # NOTE: the same settings as measure.migrate_peer's pool (prefix caching on; the benchmark
        # passes prefault=True, as the peer always does) and process (one torch thread).
        torch.set_num_threads(1)
        manager = make_manager(KVLayout(*layout_args), num_blocks, prefix_caching=True, prefault=prefault)
        super().__init__(manager, config, metrics=TransferMetrics())
        self.last_timings: dict = {}

    def kv(self, conn: str, headers: bytes, *bodies) -> bytes:
        """The endpoint's call, served on this actor's thread: an import it commits stays in the pool
        (the caller frees it with `free`); keeps the timings of the last one. Transfers gone silent
        are ended on each call."""
        reply = self.handle(conn, headers, bodies)
        for result in self._committed:
            self.last_timings = dict(result.timings)
        self._committed.clear()
        self._failed.clear()  # nacked already: the sender has the error
        with contextlib.suppress(TransferError):
            self._expire()
        return reply

    def digest(self, seq_id) -> int:
        return kv_digest(self.manager, seq_id)

    def free(self, seq_id, scrub: bool = True) -> None:
        if scrub:
            release_import(self.manager, seq_id)
        else:
            self.manager.free(seq_id)

    def touch(self, *arrays) -> int:
        """Read one byte per page of each array (warms the object store mappings in this process)."""
        return int(sum(int(a[::4096].sum()) for a in arrays))

    def stats(self) -> dict:
        self.manager.check_integrity()
        a = self.manager.allocator
        return {"free": a.num_free, "cached": a.num_cached, "used": a.num_used,
                "tables": len(self.manager.tables),
                "metrics": self.metrics.snapshot(),
                "timings": dict(self.last_timings)}
