"""Exhaustive mode: model checking a small case on the real code.

One prefill and one decode worker, 1 or 2 requests, no periodic reports. Every run is the same
world; what differs is the choices: at each message send (among the first `max_messages`) which
fault, if any, hits it (at most `max_faults` per run), and at each step which enabled event runs
next - the head of any link's queue (links are in order), any message a fault let fall behind, or,
once nothing else is on its way, the earliest timer (a `reorder` fault is what lets a message
arrive after a timeout).
Runs are enumerated depth first by their choice sequences (a run replays its prefix, then takes
the first alternative everywhere, recording how many there were). The world's state is hashed at
every choice point - on an abstraction: what is in flight, every pool's reference counts and
tables, every connection's and transfer's protocol state, the ledger and the faults left - and a
run that reaches a state already explored stops there, so no state is explored twice.
"""

from __future__ import annotations

import hashlib
import time

from dst.faults import MESSAGE_FAULTS, Fault, format_schedule
from dst.guarantees import net_model
from dst.mutants import mutant
from dst.run import quiet
from dst.workers import SimConfig, Violation
from dst.world import World

# what a fault may be in exhaustive mode ("delay" is left out: order is free here anyway; "late_read"
# too: it hits only the messages that start a pool read), of those the transport allows
KINDS = ("drop", "dup", "corrupt", "reorder", "cut", "crash_decode", "crash_prefill", "cancel", "expire",
         "supersede")
CORRUPT_ARG = 0  # flips the lowest bit of the last byte of the message's last part
DUP_CORRUPT = ("dup", "corrupt")  # two faults on one message: a copy that arrives corrupted


class _Chooser:
    def __init__(self, prefix: list[int], max_faults: int, max_messages: int, kinds):
        self.prefix, self.max_faults, self.max_messages, self.kinds = prefix, max_faults, max_messages, kinds
        self.taken: list[tuple[int, int]] = []  # (choice, alternatives) per branching point
        self.faults = 0

    def choose(self, n: int) -> int:
        i = len(self.taken)
        c = self.prefix[i] if i < len(self.prefix) else 0
        self.taken.append((c, n))
        return c

    @property
    def replaying(self) -> bool:
        return len(self.taken) < len(self.prefix)

    def faults_at(self, sent: int, kv: bool) -> list[Fault]:
        if self.faults >= self.max_faults or sent > self.max_messages:
            return []
        options = [(k,) for k in self.kinds if kv or k not in MESSAGE_FAULTS]
        if kv and self.faults + 2 <= self.max_faults and set(DUP_CORRUPT) <= set(self.kinds):
            options.append(DUP_CORRUPT)
        c = self.choose(1 + len(options))
        if c == 0:
            return []
        self.faults += len(options[c - 1])
        return [Fault(sent, kind, CORRUPT_ARG if kind == "corrupt" else 0) for kind in options[c - 1]]


def _enabled(pending) -> list[int]:
    """Indices of the events that may run next: each link's first message in order, every message
    held back by a fault, and - once no message is on its way but those held back - the earliest
    timer (a timely network: a timeout fires before a message only when a fault held it back)."""
    heads: dict[tuple[str, str], int] = {}
    out, timer = [], None
    for i, ev in enumerate(pending):
        env = ev.envelope
        if env is None:
            if timer is None or (ev.at, ev.order) < (pending[timer].at, pending[timer].order):
                timer = i
        elif env.held:
            out.append(i)
        else:
            link = (env.src, env.dst)
            if link not in heads or env.sent < pending[heads[link]].envelope.sent:
                heads[link] = i
    out += heads.values()
    if timer is not None and not heads:
        out.append(timer)
    return sorted(out, key=lambda i: pending[i].order)


def _state(world: World, faults_left: int) -> bytes:
    """A digest of the world's protocol state (see the module docstring)."""
    net, h = world.net, []
    for ev in sorted(net.pending, key=lambda e: e.order):
        env = ev.envelope
        if env is None:
            h.append(("t", ev.dst, getattr(ev.run, "__qualname__", "?")))
        else:
            h.append(("m", env.src, env.dst, env.conn, repr(env.payload), env.held))
    for w in world.workers.values():
        a, m = w.manager.allocator, w.manager
        h.append((w.name, w.incarnation, tuple(a._ref), tuple(sorted((str(k), tuple(t.blocks), t.num_tokens)
                                                                      for k, t in m.tables.items()))))
        if w.role == "prefill":
            h.append(tuple(sorted((j.rid, j.epoch, j.started, j.held, j.feed.done if j.feed else None)
                                  for j in w.jobs.values())))
            for d, s in sorted(w.sessions.items()):
                ch = s.channel
                h.append((d, s.token, s.plan is None, ch.conn, ch.connected, ch.pull, ch.offered,
                          repr(ch.inbox), ch.waiting[1].headers if ch.waiting else None,
                          net._conn_incarnation.get((ch.conn, d))))  # (which process it reaches)
        else:
            h.append((tuple(sorted(w.reserved.items())),
                      tuple(sorted((r, len(x.generated)) for r, x in w.running.items()))))
            for ident, p in list(w.receiver.peers.known.items()) + list(w.receiver.peers.strangers.items()):
                s = p.session
                h.append((ident, p.plan is None, p.token, p.pulled is None, p.source is None,
                          None if s is None else (s.manifest.request_id, s._next, s.nbytes)))
    c = world.coordinator
    h.append(tuple(sorted((r.rid, r.state.epoch, r.state.prefill, r.state.decode, tuple(r.state.tokens[0]),
                           r.state.migration is None, r.state.decoded) for r in c.live.values())))
    h.append(tuple(sorted((e.request_id, e.phase.value, e.owner, e.epoch) for e in c.ledger.active())))
    h.append(tuple(sorted(c.outcomes.items())))
    h.append(faults_left)
    return hashlib.blake2b(repr(h).encode(), digest_size=16).digest()


def explore(requests: int = 1, max_faults: int = 1, max_messages: int = 40, *, kinds=KINDS,
            mutant_name: str | None = None, time_limit_s: float = 600.0, max_steps: int = 2000,
            seed: int = 0, stage: bool = True, max_runs: int | None = None, first: list[int] = (),
            transport="zmq", stream: bool = False) -> dict:
    """Every run of the small case (see the module docstring), the decode worker landing through
    staging or not (`stage`). Returns runs, distinct states, seconds, `complete` (every run was
    explored: not stopped by a violation, `time_limit_s` or `max_runs`), and the first violation
    (with the faults and the choices that reach it), or None. first: the choices to start from (a
    violation's `choices` with max_runs=1 replays it). transport: whose declared guarantees it models
    (`dst.guarantees`): only the `kinds` it allows are placed, and the decode worker reads the
    sender's pool only where the transport reads one-sided. stream: the prefill worker migrates
    while it computes the prompt (`dst.workers.StreamFeed`)."""
    quiet()
    cfg = SimConfig(prefills=1, decodes=1, reports=False)
    model = net_model(transport)
    kinds = tuple(k for k in kinds if k in model.kinds)
    seen: set[bytes] = set()
    runs, t0, prefix = 0, time.perf_counter(), list(first)
    violation, complete = None, False
    with mutant(mutant_name):
        while True:
            runs += 1
            chooser = _Chooser(prefix, max_faults, max_messages, kinds)
            world = World(seed, [], cfg=cfg, requests=requests, pull=model.pulls, stage=stage,
                          stream=stream, transport=model)
            world.net.choose_faults = chooser.faults_at
            try:
                while world.net.pending and world.steps < max_steps:
                    enabled = _enabled(world.net.pending)
                    if len(enabled) > 1:
                        if not chooser.replaying:
                            key = _state(world, max_faults - chooser.faults)
                            if key in seen:
                                break
                            seen.add(key)
                        index = enabled[chooser.choose(len(enabled))]
                    else:
                        index = enabled[0]
                    world.step(index)
                else:
                    if not world.net.pending:
                        from dst.invariants import check_end

                        check_end(world)
            except Violation as e:
                violation = {"violation": str(e), "faults": format_schedule(world.faults),
                             "choices": [c for c, _ in chooser.taken]}
                break
            taken = chooser.taken
            while taken and taken[-1][0] + 1 >= taken[-1][1]:
                taken.pop()
            if not taken:
                complete = True
                break
            prefix = [c for c, _ in taken[:-1]] + [taken[-1][0] + 1]
            if time.perf_counter() - t0 > time_limit_s or (max_runs is not None and runs >= max_runs):
                break
    return {"runs": runs, "states": len(seen), "seconds": time.perf_counter() - t0, "violation": violation,
            "complete": complete, "requests": requests, "max_faults": max_faults,
            "max_messages": max_messages, "stage": stage, "stream": stream, "kinds": list(kinds),
            "transport": model.transport}
