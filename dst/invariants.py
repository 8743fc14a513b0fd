"""The invariants checked after every step of a simulation, and at its end (`dst.world`).

After every step, on each pool the step touched:
- blocks are conserved and reference counts are exact: free + cached + used = total, and every
  block's count equals the tables naming it plus the references held outside them (in-flight
  import reservations, export leases) - so no block is owned twice (`check_integrity`);
- no block is written while it is free: a block free before and after the step kept its bytes
  (`WriteWatch`).
At commit (`dst.workers.DecodeWorker`): the committed bytes are the sender's (the fake model's).
In the coordinator: no request is failed after every right token arrived; a request is called
vanished on a worker only if that worker had it and lost it.
At the end: every request ended within its bound, an answered request got the fake model's
tokens, the ledger holds no live request, and every pool holds only cached prefix blocks with
reference count 0, nothing in flight and no lease.
"""

from __future__ import annotations

import torch

from dst.model import generate
from dst.workers import Violation
from kvcache.allocator import IntegrityError


class WriteWatch:
    """Remembers a pool's bytes and its free blocks, to catch a write into a free block."""

    def __init__(self, manager):
        self.reset(manager)

    def reset(self, manager) -> None:
        self.manager = manager
        self.data = manager.storage.data.clone()  # (N, L, 2, B, H, D)
        self.free = _free_mask(manager)

    def check(self, manager, where: str) -> None:
        if manager is not self.manager:  # a restarted worker: a new allocator
            self.reset(manager)
            return
        data = manager.storage.data
        changed = (data != self.data).flatten(1).any(dim=1)  # (N,)
        free = _free_mask(manager)
        bad = changed & self.free & free
        if bool(bad.any()):
            blocks = torch.nonzero(bad).flatten().tolist()
            raise Violation(f"{where}: blocks {blocks} written while free")
        if bool(changed.any()):
            self.data.copy_(data)
        self.free = free


def _free_mask(manager) -> torch.Tensor:
    return torch.tensor(manager.allocator._ref) == 0  # (N,) bool; the allocator's counts, read in one go


def check_pool(worker) -> None:
    try:
        worker.manager.check_integrity(worker.extra_refs())
    except IntegrityError as e:
        raise Violation(f"{worker.name}: {e}") from None


def check_coordinator(coord) -> None:
    if coord.failed_answered:
        raise Violation(f"request {coord.failed_answered[0]!r} was failed after every right token arrived")
    for worker, rid, had, lost, holds in coord.vanished:
        if not had or (holds and not lost):
            raise Violation(f"request {rid!r} was called vanished on {worker}, which "
                            + ("never had it" if not had else "still holds it"))


def check_end(world) -> None:
    coord = world.coordinator
    for r in coord.requests.values():
        if r.ended is None:
            raise Violation(f"request {r.rid!r} never ended")
        if r.ended - r.arrived > coord.cfg.request_timeout_s + 1e-9:
            raise Violation(f"request {r.rid!r} ended after {r.ended - r.arrived:.3f}s")
        kind, what = coord.outcomes[r.rid]
        if kind == "answered" and tuple(what) != tuple(generate(list(r.prompt), r.max_tokens)):
            raise Violation(f"request {r.rid!r} was answered with the wrong tokens")
    if coord.ledger.active():
        raise Violation(f"ledger still holds {[e.request_id for e in coord.ledger.active()]}")
    for w in world.workers.values():
        check_pool(w)
        a = w.manager.allocator
        if a.num_used or w.manager.tables or w.extra_refs():
            raise Violation(f"{w.name} at quiescence: {a.num_used} blocks used, tables "
                            f"{sorted(map(str, w.manager.tables))}, {len(w.extra_refs())} held outside")
