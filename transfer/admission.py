"""Who may send KV to a receiver: the admission contract both receivers consult.

A serving decode worker accepts a transfer only for a reservation its coordinator created, and
answers a dedupe query only for the sender of such a reservation. Receivers take an object
with two methods, called on the receiver's thread before anything is allocated or looked up:

  admit_transfer(request_id, epoch, peer) -> bool   a manifest for (transfer id, epoch) from peer
  admit_query(request_id, peer) -> bool             a dedupe query for transfer id from peer
  make_room(blocks) -> None                         optional: an admitted transfer found the pool
                                                    short: free room for it if the owner can

`peer` is the name the sender gave in its handshake. A refusal is answered with `NotAdmitted`,
whose nack carries no detail. `OPEN` admits everything: for benchmarks and tests that drive a
bare receiver; a cluster's decode worker always passes its own (decode_worker).
"""

from __future__ import annotations

from transfer.errors import NotAdmitted

REFUSED = "transfer refused"


class OpenAdmission:
    """Admits every transfer and query (no coordinator behind the receiver)."""

    def admit_transfer(self, request_id: str, epoch: int, peer: str) -> bool:
        return True

    def admit_query(self, request_id: str, peer: str) -> bool:
        return True


OPEN = OpenAdmission()


def refused() -> NotAdmitted:
    return NotAdmitted(REFUSED)
