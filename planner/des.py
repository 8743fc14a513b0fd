"""The discrete-event simulation of one serving configuration. Events: arrivals, engine step ends,
migration ends. At an arrival the coordinator routes as coordinator.router does, on what each
engine last reported (its state after the last step that sent a report: as runtime.loop, a step
that produced a token, a migration's end, or any step once the 200 ms heartbeat is due; a prefill
chunk that ends no prompt reports nothing), with the configured policy (`least_loaded`,
ClusterConfig's default: most free or cached blocks, then shortest queue, the first on a tie;
`prefix_aware`: the longest cached prefix first; decode engines always least loaded) and, with
prefill workers, asks coordinator.decide (the real policy) where to prefill: on a prefill worker
(then the decode worker reserves blocks and the KV migrates, the uncached part, whole after the
prefill, from the profile's migration fit) or on the decode worker itself. A request that could
never fit an engine's pool is refused. The first token is out when the prefill ends, wherever it
ran (a prefill worker streams it before the KV leaves); a migrated request's next one after the
first decode step past its landing; every further one at the end of a decode step carrying it. A
step that decodes also takes its worker loop's own time (the serving path's `token_ms` of the
configuration's kind), and a step that finishes prompts also takes each one's serving work
(`work_ms(computed tokens, prompt tokens)` of the path the request took: migrated, i.e.
prefilled on a prefill worker: 'disaggregated'; prefilled where it decodes: 'colocated'), so
the requests queued behind it wait for that too; an engine stepping while others step is
stretched by the `contention`. Afterwards every TTFT gets the serving path's cold part,
`cold(idle)` (idle: how long the engine that prefills it had nothing to do, neither a step nor a
migration, when it arrived; before 2026-12-02 night: how long the whole cluster had, which left
a request landing on an idle worker beside a busy one warm), times the model's
`serving_stretch(engines busy then)`, plus `overhead_ms` (an extra, from the command line).
Running the serving work in series with the engine, instead of adding it to each TTFT
afterwards, is what made the model follow the queueing measured at 10-20 req/s (docs/planner.md).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from coordinator.decide import DecideConfig, DecideInputs, decide
from planner.model import StepModel
from planner.sim_engine import Job, SimEngine
from planner.workload import Req
from runtime.loop import LoopConfig

HEARTBEAT_MS = LoopConfig.__dataclass_fields__["heartbeat_s"].default * 1e3  # a report at least this often


@dataclass(frozen=True)
class SimConfig:
    """colocated > 0: that many colocated engines; else prefill + decode engines. decide: the
    coordinator.decide mode of a P+D cluster ('always' or 'auto'; 'never' leaves prefill idle).
    The engine fields match ClusterConfig / bench serve (block_size, num_blocks per engine,
    step_budget = max_num_batched_tokens)."""

    colocated: int = 0
    prefill: int = 1
    decode: int = 1
    decide: str = "always"
    step_budget: int = 512
    block_size: int = 16
    num_blocks: int = 1024
    max_num_seqs: int = 256
    local_prefill_max_tokens: int = 80
    local_prefill_max_waiting: int = 4
    prefill_ms_per_token: float = 0.0
    overhead_ms: float = 0.0
    routing: str = "least_loaded"  # coordinator.router's policy of the prefill / colocated engines

    @property
    def label(self) -> str:
        if self.colocated:
            return f"colocated {self.colocated}"
        return f"{self.prefill}P+{self.decode}D" + (" auto" if self.decide == "auto" else "")

    @property
    def workers(self) -> int:
        return self.colocated or self.prefill + self.decode


@dataclass
class Outcome:
    req: Req
    path: str = ""               # colocated, disaggregate, local_prefill, refused
    reason_kind: str = ""
    first_s: float | None = None
    end_s: float | None = None
    idle_ms: float = 0.0         # how long the engine prefilling it had been idle when it arrived
    busy_engines: int = 0        # engines stepping when it arrived
    computed_tokens: int = 0     # prompt tokens its prefill computed (cached ones excluded)
    engine: str = ""             # the engine routed to prefill it


def _engines(c: SimConfig) -> list[SimEngine]:
    spec = [("colocated", c.colocated)] if c.colocated else [("prefill", c.prefill), ("decode", c.decode)]
    return [SimEngine(f"{role}{i}", role, c.num_blocks, c.block_size, c.step_budget, c.max_num_seqs)
            for role, n in spec for i in range(n)]


def _pick(engines: list[SimEngine], req: Req, routing: str = "least_loaded") -> SimEngine:
    """As coordinator.router, on what each engine last reported (its blocks and queue after the
    last step that reported), not its state now: a request arriving while a long prompt's first
    chunks run sees that engine as it was before the prompt."""
    if routing == "prefix_aware":
        return max(engines, key=lambda e: (e.cached_tokens(req), *e.reported))
    return max(engines, key=lambda e: e.reported)


class Simulation:
    def __init__(self, reqs: list[Req], model: StepModel, config: SimConfig):
        self.model, self.c = model, config
        self.engines = _engines(config)
        self.by_role = {r: [e for e in self.engines if e.role == r]
                        for r in ("prefill", "decode", "colocated")}
        self.out = {r.index: Outcome(r) for r in reqs}
        self.decide_config = DecideConfig(config.decide if not config.colocated else "never",
                                          config.local_prefill_max_tokens, config.local_prefill_max_waiting,
                                          config.prefill_ms_per_token)
        self.migrations: list[float] = []
        self.now, self._seq, self._events = 0.0, itertools.count(), []
        self._active: dict[int, float] = {}  # id(engine) -> when it last finished a step or a migration
        # a decoding worker loop's own work per iteration (reports, stats, KV polls): the profile's
        # per-token serving cost, measured at batch 1 where one iteration is one token
        self._loop_ms = model.serving("colocated" if config.colocated else "disaggregated").token_ms
        # the serving processes' CPU beside the engines, in cores: the workload's mean arrival rate
        # times the CPU the profile measured per request (StepModel.stretch); requests that all
        # arrive at once have no rate, and no stretch
        arrivals = sorted(r.arrival_s for r in reqs)
        span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else 0.0
        rate = (len(arrivals) - 1) / span if span > 0 else 0.0
        cpu_ms = model.serving("colocated" if config.colocated else "disaggregated").cpu_ms
        self._load = rate * cpu_ms / 1e3
        self._after_step: list[SimEngine] = []
        self.target: dict[int, SimEngine] = {}    # request -> decode engine of a disaggregated request
        self._lease: dict[int, tuple[SimEngine, Job]] = {}  # import job -> (prefill engine, its job)
        for r in reqs:
            self._push(r.arrival_s * 1e3, "arrival", r)

    def _push(self, t_ms: float, kind: str, data) -> None:
        heapq.heappush(self._events, (t_ms, next(self._seq), kind, data))

    # ---- arrivals ------------------------------------------------------------------------
    def _arrive(self, req: Req) -> None:
        o, tokens = self.out[req.index], req.prompt_tokens + req.output_tokens
        o.busy_engines = sum(e.busy for e in self.engines)
        if self.c.colocated:
            e = _pick(self.by_role["colocated"], req, self.c.routing)
            o.idle_ms, o.engine = self._idle_ms(e), e.name
            if not e.fits(tokens):
                o.path = "refused"
                return
            o.path = "colocated"
            e.waiting.append(Job(req, tokens))
            return
        d = _pick(self.by_role["decode"], req)
        p = _pick(self.by_role["prefill"], req, self.c.routing)
        mean_mig = sum(self.migrations) / len(self.migrations) if self.migrations else None
        # NOTE: as the cluster: the decode worker's batch, and its prefill rate as its startup timing
        # measures it (the profile's, the same engine alone)
        dec = decide(DecideInputs(req.prompt_tokens, d.cached_tokens(req), len(p.waiting),
                                  len(d.waiting) + len(d.importing), mean_mig, len(d.running),
                                  self.model.prefill_ms_per_token), self.decide_config)
        o.path, o.reason_kind = dec.path, dec.reason_kind
        home = d if dec.path == "local_prefill" else p  # the engine that prefills it
        o.engine, o.idle_ms = home.name, self._idle_ms(home)
        if not d.fits(tokens) or (dec.path == "disaggregate" and not p.fits(req.prompt_tokens)):
            o.path = "refused"
            return
        if dec.path == "local_prefill":
            d.waiting.append(Job(req, tokens))
        else:
            self.target[req.index] = d
            p.waiting.append(Job(req, req.prompt_tokens))

    def _idle_ms(self, e: SimEngine) -> float:
        """How long engine `e` has had nothing to do (0: it steps, holds work, or sends or receives
        a migration). Re-simulating the 16 saved validations (docs/planner.md): TTFT p50 within 25% in
        54 cells of 90 against 50 with the whole cluster's idle time, per class 34 of 42 against 31,
        the goodput ranking matched in 15 runs of 16 against 14."""
        moving = any(src is e for src, _ in self._lease.values())
        if e.busy or e.load or moving:
            return 0.0
        return self.now - self._active.get(id(e), float("-inf"))

    # ---- steps ---------------------------------------------------------------------------
    def _kick(self) -> None:
        for e in self.engines:
            if e.role == "decode":
                self._imports(e)
            if e.busy:
                continue
            plan = e.plan()
            if plan.empty:
                continue
            others = sum(x.busy for x in self.engines if x is not e)
            loop = self._loop_ms if plan.decode else 0.0
            path = self.model.serving("disaggregated" if e.role == "prefill" else "colocated")
            work = sum(path.work_ms(j.req.prompt_tokens - j.cached_tokens, j.req.prompt_tokens)
                       for j, take in plan.chunks if take >= j.remaining)  # prompts this step finishes
            ms = self.model.step_ms(len(plan.decode), sum(j.context for j in plan.decode),
                                    sum(t for _, t in plan.chunks), others, loop + work, self._load)
            e.busy = True
            self._push(self.now + ms, "step", (e, plan))

    def _imports(self, d: SimEngine) -> None:
        """Prefilled prompts waiting for the decode worker's blocks: reserve, then migrate."""
        while d.importing and d.reserve(d.importing[0]):
            job = d.importing.popleft()
            ms = self.model.migration_ms(job.req.prompt_tokens - job.cached_tokens)
            self.migrations.append(ms)
            self._push(self.now + ms, "migrated", (d, job))

    def _first_token(self, e: SimEngine, job: Job) -> None:
        o = self.out[job.req.index]
        if o.first_s is None:  # a migrated request's came from its prefill worker already
            o.first_s = self.now / 1e3
        job.generated = 1
        if job.req.output_tokens == 1:
            o.end_s = o.first_s
            e.release(job)
        else:
            e.running.append(job)

    def _step_end(self, e: SimEngine, plan) -> None:
        e.busy = False
        self._active[id(e)] = self.now
        # runtime.loop reports after a step only when it produced events (a token: a decode row, or
        # a prompt's last chunk), or when the heartbeat is due; a prefill chunk that does not end its
        # prompt leaves the router with the report from before it
        emits = bool(plan.decode) or any(take >= job.remaining for job, take in plan.chunks)
        if emits or self.now - e.reported_ms >= HEARTBEAT_MS:
            self._after_step.append(e)
        for job in plan.decode:
            job.generated += 1
            if job.generated >= job.req.output_tokens:
                e.running.remove(job)
                e.release(job)
                self.out[job.req.index].end_s = self.now / 1e3
        for job, take in plan.chunks:
            job.remaining -= take
            if job.remaining > 0:
                continue
            e.prefilling.remove(job)
            e.register_prefix(job)
            self.out[job.req.index].computed_tokens = job.req.prompt_tokens - job.cached_tokens
            if e.role == "prefill":  # the first token streams from here at once (prefill_worker.handler)
                o = self.out[job.req.index]
                o.first_s = self.now / 1e3
                if job.req.output_tokens == 1:  # done here: nothing migrates
                    o.end_s = o.first_s
                    e.release(job)
                    continue
                d = self.target[job.req.index]
                imp = Job(job.req, job.req.prompt_tokens + job.req.output_tokens)
                d.importing.append(imp)
                self._lease[id(imp)] = (e, job)
            else:
                self._first_token(e, job)

    def _migrated(self, d: SimEngine, job: Job) -> None:
        src, src_job = self._lease.pop(id(job))
        src.release(src_job)          # the prefill worker's lease ends when the import committed
        self._active[id(src)] = self._active[id(d)] = self.now
        d.register_prefix(job)
        self._first_token(d, job)
        self._after_step += [src, d]  # Migrated and Imported are events: both report

    def run(self) -> list[Outcome]:
        while self._events:
            self.now, _, kind, data = heapq.heappop(self._events)
            if kind == "arrival":
                self._arrive(data)
            elif kind == "step":
                self._step_end(*data)
            else:
                self._migrated(*data)
            self._kick()
            for e in self._after_step:  # its report: the state after the step, the next step planned
                e.report(self.now)
            self._after_step.clear()
        for o in self.out.values():
            if o.first_s is not None:  # the whole stream starts later
                path = self.model.serving("disaggregated" if o.path == "disaggregate" else "colocated")
                ms = path.cold(o.idle_ms) * self.model.serving_stretch(o.busy_engines)
                shift = (self.c.overhead_ms + ms) / 1e3
                o.first_s += shift
                o.end_s = None if o.end_s is None else o.end_s + shift
        return [self.out[i] for i in sorted(self.out)]


def simulate(reqs: list[Req], model: StepModel, config: SimConfig) -> list[Outcome]:
    return Simulation(reqs, model, config).run()
