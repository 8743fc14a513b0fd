"""Credit-based backpressure and admission for one decode worker.

Before a request is prefilled for this worker the coordinator asks it to `reserve` room for the
coming migration: n sequences of num_tokens tokens, from prefill worker `sender`, under
`epoch`. The credit is granted only if free + evictable (prefix-cache) blocks, minus credit
already granted, can hold n x (prompt blocks + one block of growth); the coordinator otherwise
tries another worker or waits. A credit is consumed as its sequences are imported, and released
on abort, on a newer reservation for the request, or after its time to live (a prefill that
never came), so credit never leaks. The same credits are the KV receiver's admission
(transfer.admission): a manifest or a dedupe query that no live reservation names, for that
epoch and that sender, is refused before a block is allocated. Thread-safe: `reserve` runs on
the actor's thread, everything else on the loop thread.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass
class Reservation:
    """Credit for one request's coming migration."""

    epoch: int                # the migration epoch the coordinator issued
    sender: str               # the prefill worker that will send it
    blocks_left: int          # credit not yet turned into imported blocks
    blocks_per_sequence: int  # prompt blocks + one block of growth
    n: int                    # sequences (choices) the request migrates
    sequences_left: int
    deadline: float           # monotonic time after which the credit is released


class Credits:
    def __init__(self, block_size: int, ttl_s: float, room_blocks: int, make_room=None):
        self.block_size, self.ttl_s = block_size, ttl_s
        self._lock = threading.Lock()
        self._reserved: dict[str, Reservation] = {}
        self._room = room_blocks  # free + cached blocks as of the last settle
        self.refused = 0
        # make_room(blocks): the owner's way to keep a credit's promise when the pool is short anyway
        # (the decode handler passes its scheduler's: preempting running requests), called by a receiver
        # on the owner's thread (transfer.admission)
        self.make_room = make_room or (lambda blocks: None)

    def reserve(self, rid: str, epoch: int, num_tokens: int, n: int, sender: str) -> bool:
        """Grant credit if the room of the last settle minus the credit already granted holds it; a
        newer reservation of the same request replaces the older."""
        per_sequence = -(-num_tokens // self.block_size) + 1
        with self._lock:
            self._reserved.pop(rid, None)
            self._expire()
            if n * per_sequence > self._room - self._blocks():
                self.refused += 1
                return False
            self._reserved[rid] = Reservation(epoch, sender, n * per_sequence, per_sequence, n, n,
                                              time.monotonic() + self.ttl_s)
            return True

    def release(self, rid: str) -> None:
        with self._lock:
            self._reserved.pop(rid, None)

    def settle(self, room_blocks: int, imported: list[tuple[str, int]]) -> None:
        """The pool's room now, and the (request, epoch) of each sequence imported since the last
        settle, whose credit became real blocks. NOTE: both change together under the lock, so a
        reservation never sees the blocks counted twice or not at all."""
        with self._lock:
            self._room = room_blocks
            for rid, epoch in imported:
                r = self._reserved.get(rid)
                if r is None or r.epoch != epoch:
                    continue
                r.blocks_left -= r.blocks_per_sequence
                r.sequences_left -= 1
                if r.sequences_left <= 0:
                    del self._reserved[rid]
            self._expire()

    def reservations(self) -> int:
        with self._lock:
            return len(self._reserved)

    def reserved_blocks(self) -> int:
        with self._lock:
            return self._blocks()

    # ---- admission (transfer.admission) -----------------------------------------------------------
    def admit_transfer(self, transfer_id: str, epoch: int, peer: str) -> bool:
        with self._lock:
            r = self._for(transfer_id, peer)
            return r is not None and r.epoch == epoch

    def admit_query(self, transfer_id: str, peer: str) -> bool:
        with self._lock:
            return self._for(transfer_id, peer) is not None

    # ---- lock held --------------------------------------------------------------------------------
    def _for(self, transfer_id: str, peer: str) -> Reservation | None:
        rid, _, index = transfer_id.rpartition("/")
        r = self._reserved.get(rid)
        ok = r is not None and r.sender == peer and index.isdigit() and int(index) < r.n \
            and r.deadline > time.monotonic()
        return r if ok else None

    def _blocks(self) -> int:
        return sum(r.blocks_left for r in self._reserved.values())

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [rid for rid, r in self._reserved.items() if r.deadline < now]:
            del self._reserved[rid]
