"""What the simulated network and faults may do, derived from one transport's declared delivery
`Guarantees` (`transfer.registry`): the simulator models exactly what a channel declares.

- `ordered_per_caller`: the KV messages of one connection (a caller) arrive in the order they
  were sent; connections are not ordered with each other (an old connection's message may arrive
  after a newer one's). False: no order at all on the KV wire, and `reorder` faults are drawn.
- `reply_may_be_lost_after_running`: a message can run on the receiver while its answer is lost:
  `drop` may hit the receiver's replies and `cut` (a broken link: everything later on the
  connection lost, both ways) and `delay` (a message arriving after the sender's timeout) are
  drawn. False: only requests can be lost (before they ran), nothing is cut or held back past a
  timeout.
- `restarts`: a crashed worker restarts under the same name with its memory lost, and a
  connection opened before the crash reaches the new process. False: it comes back at a new
  address; a connection opened before the crash leads nowhere (its messages are lost). Either way
  `crash_decode`/`crash_prefill` are drawn (a process can die under any transport).
- `one_sided_reads_are_events`: the receiver reads payloads from the sender's pool (prefill
  workers offer it; otherwise bytes are pushed), and `late_read` is drawn: the read a message
  starts does not finish within its bound (the transfer fails with TransferTimeout). With
  `issued_read_cancellable` False the read, once issued, still lands later - an event, not a
  message - unless the source was closed first (what a NIXL agent's close does); True: it is
  cancelled with the transfer.

The control plane (the coordinator's commands and the workers' events: Ray calls) is the same
under every transport: in order per link, only ever late.
"""

from __future__ import annotations

from dataclasses import dataclass

from dst.faults import KINDS, MESSAGE_FAULTS
from transfer.registry import Guarantees, get


@dataclass(frozen=True)
class NetModel:
    """The network one transport's guarantees allow (see the module docstring)."""

    transport: str
    guarantees: Guarantees

    @property
    def kinds(self) -> tuple[str, ...]:
        """The fault kinds a seed may draw under these guarantees."""
        g, out = self.guarantees, []
        for kind in KINDS:
            if kind == "reorder" and g.ordered_per_caller:
                continue
            if kind in ("cut", "delay") and not g.reply_may_be_lost_after_running:
                continue
            if kind == "late_read" and not g.one_sided_reads_are_events:
                continue
            out.append(kind)
        return tuple(out)

    def admits(self, kind: str, kv: bool, reply: bool, reads: bool = False) -> bool:
        """Whether fault `kind` may hit this message: a KV message (`kv`), a receiver's reply to its
        sender (`reply`), one that starts a pool read (`reads`: "P" offsets, "K" checksums), or a
        command or event (the control plane: only ever late)."""
        if kind not in self.kinds:
            return False
        if not kv:
            return kind == "delay" or kind not in MESSAGE_FAULTS
        if kind == "drop" and reply:
            return self.guarantees.reply_may_be_lost_after_running
        if kind == "late_read":
            return reads
        return True

    @property
    def ordered(self) -> bool:
        return self.guarantees.ordered_per_caller

    @property
    def restarts(self) -> bool:
        return self.guarantees.restarts

    @property
    def pulls(self) -> bool:
        return self.guarantees.one_sided_reads_are_events

    @property
    def late_reads_land(self) -> bool:
        return self.guarantees.one_sided_reads_are_events and not self.guarantees.issued_read_cancellable


def net_model(transport: str | NetModel = "zmq") -> NetModel:
    """The model of a registered transport (by name, or a "module:attr" path), or `transport` itself."""
    if isinstance(transport, NetModel):
        return transport
    return NetModel(transport, get(transport).guarantees)

