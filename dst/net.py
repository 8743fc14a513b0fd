"""The simulated network, the virtual clock and the seeded scheduler.

Everything that happens is an event in `pending`: a message on its way (`Envelope`) or a timer.
`step` picks the next one (`pick`: by default the earliest, ties broken by a seeded draw; the
exhaustive explorer passes its own) and runs it; the clock jumps to its time. What the network may
do is the transport's declared guarantees (`model`, a `dst.guarantees.NetModel`): with
`ordered_per_caller` the KV messages of one connection arrive in the order they were sent (other
connections' may overtake them) and no `reorder` fault is drawn; commands and events (Ray calls)
arrive in order per link. The faults of the schedule fire at message boundaries (`dst.faults`),
only those the model admits for that message. A node restarted by a crash gets a new
incarnation: timers and deliveries addressed to the old one are dropped, and without `restarts`
(a new address) so is every later message on a connection opened before the crash.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field

from dst.faults import MESSAGE_FAULTS, Fault
from dst.guarantees import NetModel, net_model

WORLD = "world"  # the node world faults run on
COORDINATOR = "coord"  # the coordinator's node (commands and reports: production's protocol.messages)


@dataclass
class Event:
    at: float
    tie: float
    order: int
    dst: str
    incarnation: int | None  # the destination's incarnation it is for (None: any)
    run: object  # callable() for a timer; None for a message
    envelope: Envelope | None = None
    readonly: bool = False  # a timer that changes no pool (a report): no invariant to check after it

    def __lt__(self, other: Event) -> bool:
        return (self.at, self.tie, self.order) < (other.at, other.tie, other.order)


@dataclass
class Envelope:
    sent: int          # its send ordinal (1-based)
    src: str
    dst: str
    conn: bytes        # the connection it belongs to (KV messages), or b""
    payload: object    # list of byte parts (KV wire), or a command/event object
    link_seq: int = 0  # its place in its link's order
    held: bool = False  # not in its link's order (a reorder fault, or an unordered transport)
    late_read: int | None = None  # a late_read fault: the pool read it starts is late (its arg)


@dataclass
class Network:
    """seed: latencies and ties. faults: the schedule to apply. rates: fault kind -> probability per
    message send, drawn from their own generator (so the latencies do not depend on them) and
    recorded in `fired` as an explicit schedule: replaying `fired` with no rates is the same run."""

    seed: int
    faults: list[Fault] = field(default_factory=list)
    rates: dict = field(default_factory=dict)
    latency: tuple[float, float] = (0.0002, 0.003)
    model: NetModel | str = "zmq"  # the transport whose guarantees it models (dst.guarantees)

    def __post_init__(self):
        self.model = net_model(self.model)
        self.reading: Envelope | None = None  # the message being delivered (its late_read fault)
        self._conn_incarnation: dict[tuple[bytes, str], int] = {}  # (conn, dst) -> dst's when opened
        self.rng = random.Random(self.seed)
        self.conn_ids = itertools.count(1)  # connection names, per world (a replay names them alike)
        self.choose_faults = None  # the explorer's hook: (send ordinal, KV message?) -> faults to apply
        self.fault_rng = random.Random(self.seed ^ 0xFA17)
        self.now = 0.0
        self.pending: list[Event] = []
        self.sent = 0
        self.order = 0
        self.nodes: dict = {}
        self.on_world_fault = None  # callable(Fault), set by the world
        self._by_at: dict[int, list[Fault]] = {}
        for f in self.faults:
            self._by_at.setdefault(f.at, []).append(f)
        self._link_last: dict[tuple[str, str, bytes], float] = {}
        self._cut: set[bytes] = set()
        self.fired: list[Fault] = []
        self.trace: list[str] = []

    def clock(self) -> float:
        return self.now

    # ---- sending ----------------------------------------------------------------------------------
    def send(self, src: str, dst: str, payload, conn: bytes = b"") -> None:
        self.sent += 1
        faults = list(self._by_at.get(self.sent, ()))
        for kind, p in self.rates.items():
            if self.fault_rng.random() < p:
                faults.append(Fault(self.sent, kind, self.fault_rng.randrange(1 << 16)))
        if self.choose_faults is not None:
            faults += self.choose_faults(self.sent, bool(conn))
        reply = bool(conn) and conn.partition(b"#")[0].decode() != src  # a receiver's answer
        reads = bool(conn) and not reply and payload[0][:1] in (b"P", b"K")  # the receiver reads a pool
        faults = [f for f in faults if self.model.admits(f.kind, bool(conn), reply, reads)]
        kinds = {f.kind: f for f in faults if f.kind in MESSAGE_FAULTS}
        for f in faults:
            self.fired.append(f)
        if conn and conn in self._cut:
            return
        if conn and not self._reaches(conn, dst):
            return  # a connection to a process that is gone: the new one listens elsewhere
        env = Envelope(self.sent, src, dst, conn, payload)
        if "late_read" in kinds:
            env.late_read = kinds["late_read"].arg
        if "cut" in kinds and conn:
            self._cut.add(conn)
            return
        if "drop" not in kinds:
            corrupt = kinds.get("corrupt")
            if corrupt is not None and "dup" not in kinds:
                env.payload = _corrupt(payload, corrupt.arg)
            extra = 0.0
            if "delay" in kinds or "reorder" in kinds:
                extra = 0.05 + (kinds.get("delay") or kinds["reorder"]).arg % 2000 / 1000
            unordered = bool(conn) and not self.model.ordered
            self._schedule(env, extra, held="reorder" in kinds or unordered)
            if "dup" in kinds:  # a corrupt fault on a duplicated message hits the copy
                body = _corrupt(payload, corrupt.arg) if corrupt else payload
                copy = Envelope(self.sent, src, dst, conn, body)
                self._schedule(copy, 0.0005 + kinds["dup"].arg % 50 / 1000, held=True)
        for f in faults:  # world faults fire right after the message left (a message boundary)
            if f.kind not in MESSAGE_FAULTS and self.on_world_fault is not None:
                self._push(Event(self.now, -1.0, 0, WORLD, None, lambda f=f: self.on_world_fault(f)))

    def _reaches(self, conn: bytes, dst: str) -> bool:
        """Whether a message on `conn` reaches `dst`: always under `restarts` (the same name);
        otherwise only the incarnation of `dst` that was there when the connection was opened."""
        node = self.nodes.get(dst)
        incarnation = getattr(node, "incarnation", None)
        opened = self._conn_incarnation.setdefault((conn, dst), incarnation)
        return self.model.restarts or opened == incarnation

    def _schedule(self, env: Envelope, extra: float, held: bool) -> None:
        link = (env.src, env.dst, env.conn)  # a caller: one connection, or the control plane's link
        at = self.now + self.rng.uniform(*self.latency) + extra
        if not held:  # in order on its link: never before the last message sent on it
            at = max(at, self._link_last.get(link, -1.0) + 1e-7)
            self._link_last[link] = at
        env.held = held
        node = self.nodes.get(env.dst)
        self._push(Event(at, self.rng.random(), 0, env.dst, getattr(node, "incarnation", None), None, env))

    def timer(self, dst: str, at: float, run, readonly: bool = False) -> None:
        """Run `run()` at virtual time `at`, unless `dst` restarted meanwhile."""
        node = self.nodes.get(dst)
        self._push(Event(at, self.rng.random(), 0, dst, getattr(node, "incarnation", None), run,
                         readonly=readonly))

    def _push(self, ev: Event) -> None:
        self.order += 1
        ev.order = self.order
        heapq.heappush(self.pending, ev)  # a heap: the default pick is its head

    # ---- running ----------------------------------------------------------------------------------
    def take(self, index: int | None = None) -> Event:
        """Remove the next event: the earliest (ties broken by the seeded draw), or `pending[index]`."""
        if index is None or index == 0:
            return heapq.heappop(self.pending)
        ev = self.pending.pop(index)
        heapq.heapify(self.pending)
        return ev

    def step(self, index: int | None = None) -> bool:
        """Run one event (the scheduler's pick, or `pending[index]`); False when none is left."""
        if not self.pending:
            return False
        self.run_event(self.take(index))
        return True

    def run_event(self, ev: Event) -> None:
        self.now = max(self.now, ev.at)
        node = self.nodes.get(ev.dst)
        if node is None or (ev.incarnation is not None and ev.incarnation != node.incarnation):
            return  # addressed to a process that is gone
        if ev.envelope is None:
            ev.run()
        else:
            self.reading = ev.envelope
            try:
                node.on_message(ev.envelope)
            finally:
                self.reading = None


def _corrupt(payload, arg: int):
    """`payload` (byte parts) with one bit of its last part flipped, counting bytes from its end
    (arg 0: the lowest bit of the last byte); other payloads unchanged."""
    if not (isinstance(payload, list) and payload and len(payload[-1])):
        return payload
    last = bytearray(payload[-1])
    last[len(last) - 1 - arg % len(last)] ^= 1 << (arg >> 8) % 8
    return payload[:-1] + [bytes(last)]
