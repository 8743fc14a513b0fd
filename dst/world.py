"""One simulated cluster, built from a seed: the network, the coordinator, the workers, the
clients' requests and the fault schedule; `run` steps it to the end, checking the invariants
(`dst.invariants`) after every step."""

from __future__ import annotations

import random

from dst.coordinator import SimCoordinator
from dst.faults import Fault, draw_rates
from dst.guarantees import NetModel, net_model
from dst.invariants import WriteWatch, check_coordinator, check_end, check_pool
from dst.net import WORLD, Network
from dst.workers import DecodeWorker, PrefillWorker, SimConfig, Violation
from transfer.registry import register_source
from transfer.schema import Limits
from transfer.transport import TransportConfig

PREFIXES = ((11, 12, 13, 14, 15, 16, 17, 18), (21, 22, 23, 24, 25, 26, 27, 28))


def transport_config() -> TransportConfig:
    """Small chunks (several per block run), small inline payloads (dedupe queries happen) and
    bounds of a fraction of a virtual second."""
    return TransportConfig(chunk_bytes=64, inline_bytes=100, connect_timeout_s=0.4, transfer_timeout_s=0.8,
                           idle_timeout_s=0.5, max_transfer_s=1.5, lease_s=1.5, peer_name="", copy_threads=1,
                           limits=Limits(min_chunk_bytes=64))


class World:
    def __init__(self, seed: int, faults: list[Fault] | None = None, *, cfg: SimConfig | None = None,
                 requests: int | None = None, pull: bool | None = None, stage: bool | None = None,
                 stream: bool | None = None, transport: str | NetModel = "zmq"):
        """faults: the schedule to replay (None: drawn from the seed's rates as it runs; either way
        `faults` is the schedule that fired). transport: whose declared guarantees the network and
        the faults model (`dst.guarantees`); a scheduled fault it does not allow is a ValueError."""
        self.seed, self.cfg = seed, cfg or SimConfig()
        self.model = model = net_model(transport)
        bad = sorted({f.kind for f in faults or ()} - set(model.kinds))
        if bad:
            raise ValueError(f"transport {model.transport!r} does not allow the faults {', '.join(bad)} "
                             f"(its faults: {', '.join(model.kinds)})")
        register_source("sim", "dst.channel:SimSource")  # the pool reader of this world's pull offers
        rng = random.Random(seed ^ 0x5EED)
        rates = draw_rates(rng, model.kinds)
        self.net = Network(seed, sorted(faults or ()), rates if faults is None else {}, model=model)
        drawn = rng.random() < 0.5 and model.pulls  # pushed bytes unless the transport reads one-sided
        self.net.pull = drawn if pull is None else pull  # prefill workers offer their pool to read from
        drawn = rng.random() < 0.5  # decode workers land payloads through staging (a device pool's way)
        self.net.stage = drawn if stage is None else stage
        # prefill workers migrate while they compute (streamed); from its own draw, so that the
        # seeds' other draws stay as they were before streamed migrations were simulated
        drawn = random.Random(seed ^ 0x57EA).random() < 0.5
        self.net.stream = drawn if stream is None else stream
        self.net.on_world_fault = self._world_fault
        self.net.nodes[WORLD] = self
        self.incarnation, self.request_ids, self._dirty = 0, [], False
        tcfg = transport_config()
        self.workers = {}
        for i in range(self.cfg.prefills):
            w = PrefillWorker(self.net, f"prefill-{i}", self.cfg, _named(tcfg, f"prefill-{i}"))
            self.workers[w.name] = w
        for i in range(self.cfg.decodes):
            w = DecodeWorker(self.net, f"decode-{i}", self.cfg, _named(tcfg, f"decode-{i}"))
            self.workers[w.name] = w
        self.coordinator = SimCoordinator(self.net, self.workers, self.cfg)
        self.watch = {n: WriteWatch(w.manager) for n, w in self.workers.items()}
        for i in range(requests if requests is not None else rng.randint(1, 3)):
            prefix = PREFIXES[rng.randrange(len(PREFIXES))]
            tail = tuple(rng.randint(30, 90) for _ in range(rng.randint(0, 9)))
            prompt = prefix[:rng.randint(3, len(prefix))] + tail
            rid, at, n = f"r{i}", rng.uniform(0.0, 0.05), rng.randint(1, 4)
            self.request_ids.append(rid)
            self.net.timer(self.coordinator.name, at,
                           lambda rid=rid, p=prompt, n=n: self.coordinator.arrive(rid, p, n))
        self.steps = 0

    @property
    def faults(self) -> list[Fault]:
        return list(self.net.fired)

    def _world_fault(self, f: Fault) -> None:
        prefills = [w for w in self.workers.values() if w.role == "prefill"]
        decodes = [w for w in self.workers.values() if w.role == "decode"]
        rids = self.request_ids
        if f.kind in ("crash_decode", "crash_prefill"):
            role = decodes if f.kind == "crash_decode" else prefills
            victim = role[f.arg % len(role)]
            victim.crash(wipe=bool(f.arg >> 4 & 1))
            self.coordinator.crashed(victim.name)  # Ray tells the coordinator's driver at once
        elif f.kind == "cancel":
            self.coordinator.cancel(rids[f.arg % len(rids)])
        elif f.kind == "supersede":
            self.coordinator.supersede(rids[f.arg % len(rids)])
        elif f.kind == "expire":
            rx = decodes[f.arg % len(decodes)].receiver
            for p in rx.active.values():
                p.session.last_activity = float("-inf")
            rx.expire()
        self._dirty = True

    def step(self, index: int | None = None) -> bool:
        """One event; the invariants checked on what it touched. False when nothing is left."""
        if not self.net.pending:
            return False
        self._dirty = False
        ev = self.net.take(index)
        self.net.run_event(ev)
        self.steps += 1
        if ev.readonly and not self._dirty:
            return True
        if self._dirty:  # a world fault: anything may have changed
            touched = list(self.workers.values())
        else:
            touched = [self.workers[ev.dst]] if ev.dst in self.workers else []
        for w in touched:
            check_pool(w)
            self.watch[w.name].check(w.manager, f"{w.name} at {self.net.now:.4f}s")
        check_coordinator(self.coordinator)
        return True

    def run(self, max_steps: int = 200_000) -> None:
        """Step to the end (nothing pending), then check the end state; raises Violation."""
        while self.step():
            if self.steps > max_steps:
                raise Violation(f"no quiescence after {max_steps} steps")
        check_end(self)


def _named(cfg: TransportConfig, name: str) -> TransportConfig:
    import dataclasses

    return dataclasses.replace(cfg, peer_name=name)
