"""Running seeds: one (`run_seed`), many (`run_seeds`), and a failure made small (`shrink`) and
replayable from one command line (`replay_command`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from dst.faults import Fault, format_schedule
from dst.guarantees import NetModel, net_model
from dst.mutants import mutant
from dst.workers import Violation
from dst.world import World


@dataclass
class Outcome:
    seed: int
    faults: list[Fault]
    violation: str | None
    steps: int
    answered: int
    failed: int


def quiet() -> None:
    """Silence what the simulation makes happen on purpose: ledger discrepancies, refusals and
    failover warnings."""
    for name in ("coordinator.reconcile", "coordinator.core", "transfer.refusals"):
        logging.getLogger(name).setLevel(logging.ERROR)


def run_seed(seed: int, faults: list[Fault] | None = None, **world) -> Outcome:
    """One seed (its faults drawn from it unless given); a broken invariant is its `violation`."""
    w = World(seed, faults, **world)
    try:
        w.run()
        violation = None
    except Violation as e:
        violation = str(e)
    kinds = [k for k, _ in w.coordinator.outcomes.values()]
    return Outcome(seed, list(w.faults), violation, w.steps, kinds.count("answered"), kinds.count("failed"))


def run_seeds(first: int, count: int, *, mutant_name: str | None = None, stop_at_first: bool = True,
              progress: Callable[[dict], None] | None = None, every: int = 10_000, **world) -> dict:
    """Seeds first..first+count-1 (under `mutant_name`, if given). Returns seeds run, seconds,
    requests answered and failed, faults fired, and the failing outcomes. progress: told the
    totals so far (with `seconds` and `broken`) after every `every` seeds."""
    failures, t0 = [], time.perf_counter()
    totals = {"seeds": 0, "answered": 0, "failed": 0, "faults": 0, "steps": 0}
    quiet()
    with mutant(mutant_name):
        for seed in range(first, first + count):
            if progress is not None and totals["seeds"] and totals["seeds"] % every == 0:
                progress({**totals, "seconds": time.perf_counter() - t0, "broken": len(failures)})
            out = run_seed(seed, **world)
            totals["seeds"] += 1
            totals["answered"] += out.answered
            totals["failed"] += out.failed
            totals["faults"] += len(out.faults)
            totals["steps"] += out.steps
            if out.violation is not None:
                failures.append(out)
                if stop_at_first:
                    break
    return {**totals, "seconds": time.perf_counter() - t0, "failures": failures}


def shrink(seed: int, faults: list[Fault], mutant_name: str | None = None, **world) -> list[Fault]:
    """The smallest sub-schedule of `faults` (one fault removed at a time, until none can be) under
    which `seed` still breaks an invariant."""
    with mutant(mutant_name):
        current = list(faults)
        changed = True
        while changed:
            changed = False
            for i in range(len(current)):
                trial = current[:i] + current[i + 1:]
                if run_seed(seed, trial, **world).violation is not None:
                    current, changed = trial, True
                    break
    return current


def replay_command(seed: int, faults: list[Fault], mutant_name: str | None = None, *,
                   transport: str | NetModel = "zmq", **world) -> str:
    """The one line that replays this run exactly: under the same transport's guarantees (always
    named), with `world` the non-default shape it ran with."""
    cmd = f"pdserve bench sim --seed {seed} --faults '{format_schedule(faults)}'"
    cmd += f" --transport {net_model(transport).transport}"
    for key, value in world.items():
        cmd += f" --{key} {value}"
    return cmd + (f" --mutant {mutant_name}" if mutant_name else "")
