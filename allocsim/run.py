"""The simulator's step loop: one deterministic trace through one policy, and the metrics it yields.

Each step t = 0, 1, 2, ...:
1. requests that finished during step t-1 release all their memory;
2. requests with arrival == t, in file order, get their initial allocation or are rejected for good;
3. every active request, in admission order (this step's admissions included), appends one token;
   a request that cannot grow is aborted (a growth failure) and frees its memory at once; one whose
   generated count reaches `output` is finished (it keeps its memory until step t+1);
4. measure: reserved slots and live tokens (prompt + generated) of active and just-finished
   requests, waste = reserved - live, free slots, largest contiguous free interval.
The run ends after the first step at which no request is active or still to arrive. A rejection
or growth failure is a failure despite free capacity when the free slots just before the attempt
were at least the slots it asked for (external fragmentation). After the run every policy must
have all its memory back; anything else is a leak and raises.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field

from allocsim.policies import Segment, make_policies
from allocsim.scenario import Request, Scenario


@dataclass(frozen=True)
class StepStats:
    """Measurements at the end of one step (slots are token slots)."""

    step: int
    reserved: int
    live: int
    waste: int
    free: int
    largest_free_interval: int


@dataclass(frozen=True)
class Event:
    """Something that happened to a request: admitted, rejected, growth_failure or finished.

    free: free slots just before the attempt; asked: slots the attempt asked for (0 for finished).
    """

    step: int
    kind: str
    request: str
    free: int
    asked: int


@dataclass
class PolicyResult:
    """Counts, the per-step series, the event log and (optionally) the slot layout of every step."""

    name: str
    capacity: int
    admitted: int = 0
    rejected: int = 0
    growth_failures: int = 0
    failures_despite_free_capacity: int = 0
    completed: int = 0
    steps: int = 0
    series: list[StepStats] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    layouts: list[list[Segment]] = field(default_factory=list)

    @property
    def peak_reserved(self) -> int:
        return max(s.reserved for s in self.series)

    @property
    def peak_live(self) -> int:
        return max(s.live for s in self.series)

    @property
    def peak_waste(self) -> int:
        return max(s.waste for s in self.series)

    def to_json(self) -> dict:
        """The JSON record of the issue's schema (no event log, no layout)."""
        return {
            "name": self.name, "admitted": self.admitted, "rejected": self.rejected,
            "growth_failures": self.growth_failures,
            "failures_despite_free_capacity": self.failures_despite_free_capacity,
            "completed": self.completed, "peak_reserved": self.peak_reserved, "peak_live": self.peak_live,
            "peak_waste": self.peak_waste, "steps": self.steps,
            "series": [asdict(s) for s in self.series],
        }


@dataclass
class _Active:
    req: Request
    generated: int = 0


def run_policy(scenario: Scenario, policy, record_layout: bool = False, check: bool = False) -> PolicyResult:
    """Run the trace through one fresh policy. check=True verifies the policy's integrity every step."""
    res = PolicyResult(policy.name, scenario.capacity)
    empty_free = policy.free_slots()
    pending = deque(sorted(scenario.requests, key=lambda r: r.arrival))  # stable: file order breaks ties
    active: list[_Active] = []
    finishing: list[_Active] = []
    t = 0
    while True:
        for a in finishing:  # 1. finished during step t-1
            policy.release(a.req.id)
        finishing = []
        while pending and pending[0].arrival == t:  # 2. arrivals, in file order
            req = pending.popleft()
            asked, free = policy.admit_slots(req), policy.free_slots()
            if policy.admit(req):
                res.admitted += 1
                active.append(_Active(req))
                res.events.append(Event(t, "admitted", req.id, free, asked))
            else:
                res.rejected += 1
                res.failures_despite_free_capacity += free >= asked
                res.events.append(Event(t, "rejected", req.id, free, asked))
        still: list[_Active] = []
        for a in active:  # 3. one token each, in admission order
            rid = a.req.id
            asked, free = policy.grow_slots(rid), policy.free_slots()
            if not policy.grow(rid):
                policy.release(rid)
                res.growth_failures += 1
                res.failures_despite_free_capacity += free >= asked
                res.events.append(Event(t, "growth_failure", rid, free, asked))
                continue
            a.generated += 1
            if a.generated == a.req.output:
                res.completed += 1
                finishing.append(a)
                res.events.append(Event(t, "finished", rid, policy.free_slots(), 0))
            else:
                still.append(a)
        active = still
        live = {a.req.id: a.req.prompt + a.generated for a in active + finishing}  # 4. measure
        reserved = sum(policy.held(rid) for rid in live)
        res.series.append(StepStats(t, reserved, sum(live.values()), reserved - sum(live.values()),
                                    policy.free_slots(), policy.largest_free_interval()))
        if record_layout:
            res.layouts.append(policy.layout(live))
        if check:
            policy.check_integrity()
        t += 1
        if not active and not pending:
            break
    for a in finishing:
        policy.release(a.req.id)
    if policy.free_slots() != empty_free:
        leaked = empty_free - policy.free_slots()
        raise RuntimeError(f"{policy.name}: {leaked} slots still held after the run")
    res.steps = t
    return res


def simulate(scenario: Scenario, record_layout: bool = False, check: bool = False) -> list[PolicyResult]:
    """Every policy (max_reservation, exact_contiguous, paged_B...) on the same trace, in report order."""
    return [run_policy(scenario, p, record_layout, check) for p in make_policies(scenario)]


def results_to_json(results: list[PolicyResult]) -> dict:
    return {"policies": [r.to_json() for r in results]}


def format_table(results: list[PolicyResult]) -> str:
    """One row per policy, fixed-width columns."""
    cols = [("policy", "name", 16), ("admitted", "admitted", 8), ("rejected", "rejected", 8),
            ("growth_fail", "growth_failures", 11), ("fail_w/_free", "failures_despite_free_capacity", 12),
            ("completed", "completed", 9), ("peak_resv", "peak_reserved", 9), ("peak_live", "peak_live", 9),
            ("peak_waste", "peak_waste", 10), ("steps", "steps", 5)]
    lines = ["  ".join(f"{h:<{w}}" if k == "name" else f"{h:>{w}}" for h, k, w in cols)]
    for r in results:
        lines.append("  ".join(f"{getattr(r, k):<{w}}" if k == "name" else f"{getattr(r, k):>{w}}"
                               for _, k, w in cols))
    return "\n".join(lines)
