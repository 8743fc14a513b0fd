"""The faults a seed can draw, and the schedule that places them.

A seed draws fault rates (`draw_rates`: swarm testing, each kind on or off per seed); the faults
that fire are recorded as an explicit schedule, which replays and shrinks. Every fault is placed
at a message boundary: it fires when the world sends its `at`-th message
(counting from 1). Message faults act on that message: `drop`, `dup` (delivered twice, the copy
later), `delay` (held back; later messages on its link wait behind it), `reorder` (held back;
later messages overtake it), `corrupt` (one byte of its last part flipped), `cut` (it and every
later message of its connection lost: a bulk link cut; the sender times out and reconnects),
`late_read` (the pool read this message starts, "P" offsets or "K" checksums, does not finish
within its bound; it may land later: `dst.guarantees`).
World faults act at that moment: `crash_decode` / `crash_prefill` (the worker restarts with its
memory lost; arg 1: its pool wiped too, 0: kept), `cancel` (the client cancels request `arg`),
`expire` (every transfer the decode worker has in flight passes its idle bound now: a lease
expiry), `supersede` (the coordinator reruns request `arg` under a newer epoch, as its failover
does, while the old attempt may still be in flight). A schedule is written `at:kind:arg,...`
(`format_schedule`, `parse_schedule`) so a failure replays from one command line.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

MESSAGE_FAULTS = ("drop", "dup", "delay", "reorder", "corrupt", "cut", "late_read")
WORLD_FAULTS = ("crash_decode", "crash_prefill", "cancel", "expire", "supersede")
KINDS = MESSAGE_FAULTS + WORLD_FAULTS


@dataclass(frozen=True, order=True)
class Fault:
    at: int    # fires at the world's at-th message send
    kind: str
    arg: int = 0


def draw_rates(rng: random.Random, kinds=KINDS) -> dict[str, float]:
    """Swarm testing: each kind is enabled or not for this seed, and an enabled one fires at each
    message send with a probability drawn for the seed (world faults rarer than message faults).
    Only `kinds` (those the transport allows: `dst.guarantees`) are ever enabled; the draws for
    the others are made all the same, so a seed's other draws do not depend on them."""
    rates = {}
    for kind in KINDS:
        if rng.random() < 0.5:
            rate = rng.uniform(0.0, 0.05 if kind in MESSAGE_FAULTS else 0.01)
            if kind == "late_read":  # it hits only the few messages that start a pool read
                rate *= 6
            if kind in kinds:
                rates[kind] = rate
    return rates


def format_schedule(faults) -> str:
    return ",".join(f"{f.at}:{f.kind}:{f.arg}" for f in faults)


def parse_schedule(text: str) -> list[Fault]:
    """The schedule `format_schedule` wrote; ValueError naming a bad item."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        at, kind, arg = (item.split(":") + ["0"])[:3]
        if kind not in KINDS:
            raise ValueError(f"unknown fault {kind!r} in {item!r}; kinds: {', '.join(KINDS)}")
        out.append(Fault(int(at), kind, int(arg)))
    return sorted(out)
