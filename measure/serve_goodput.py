"""Goodput as DistServe defines it: the highest request rate at which at least `target` (90%) of
requests meet both SLOs, found by a search over rates, with a confidence interval.

The search (`search`): measure at a start rate; while every rate tried passes, double it (up to
`max_rate`); while every one fails, halve it (down to `min_rate`: below, the goodput is 0); once a
passing rate lies below a failing one, bisect between the highest passing rate under the lowest
failing one and that failing rate, until they are within `rel_tol` of each other or `steps`
measurements were made in all. The goodput is that highest passing rate (the bracket's low end).

The interval (`interval`) comes from a bootstrap on the attainment at every rate measured: each
rate's per-request SLO flags resampled `draws` times give a two-sided `confidence` interval of its
attainment. The interval's low end is the highest rate, at or below the goodput, whose attainment
interval lies wholly at or above the target (it surely passes; 0 if none); its high end is the
lowest rate above the goodput whose attainment interval lies wholly below (it surely fails; None,
unbounded, if none was measured). The bisection bracket always lies within it. Two goodputs whose
intervals overlap are a tie (`tie`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

CI_METHOD = ("bootstrap on each measured rate's per-request SLO flags: low = the highest rate at or "
             "below the goodput whose attainment interval lies wholly >= target, high = the lowest rate "
             "above it whose interval lies wholly < target (None: none measured)")


@dataclass(frozen=True)
class SearchConfig:
    """start_rate: the first rate tried (req/s). steps: measurements in all. target: the attainment a
    rate must reach. min_rate / max_rate: bounds of the search. rel_tol: stop bisecting when the
    failing rate is within this share above the passing one. confidence / draws / seed: the
    bootstrap of the interval."""

    start_rate: float = 1.0
    steps: int = 6
    target: float = 0.9
    min_rate: float = 0.05
    max_rate: float = 64.0
    rel_tol: float = 0.1
    confidence: float = 0.95
    draws: int = 2000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("start_rate", "min_rate", "max_rate", "rel_tol"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be finite and > 0, got {v}")
        if not self.min_rate <= self.start_rate <= self.max_rate:
            raise ValueError(f"start_rate {self.start_rate} must lie within "
                             f"[{self.min_rate}, {self.max_rate}]")
        if self.steps < 1 or not 0 < self.target <= 1 or not 0 < self.confidence < 1 or self.draws < 1:
            raise ValueError("steps and draws must be >= 1, target in (0, 1], confidence in (0, 1)")


def attainment(flags: list[bool]) -> float:
    """The share of requests that met both SLOs (a failed request counts as missing them)."""
    return sum(map(bool, flags)) / len(flags) if flags else 0.0


def _bracket(points: dict[float, float], target: float) -> tuple[float | None, float | None]:
    """(highest passing rate below the lowest failing one, that failing rate); None where none."""
    fails = [r for r, a in points.items() if a < target]
    hi = min(fails) if fails else None
    passes = [r for r, a in points.items() if a >= target and (hi is None or r < hi)]
    return (max(passes) if passes else None), hi


def next_rate(points: dict[float, float], cfg: SearchConfig) -> float | None:
    """The next rate to measure given attainment per rate measured so far; None: the search is done."""
    if not points:
        return cfg.start_rate
    lo, hi = _bracket(points, cfg.target)
    if hi is None:  # everything passed: grow
        top = max(points)
        return None if top >= cfg.max_rate else min(cfg.max_rate, 2 * top)
    if lo is None:  # everything below the lowest failure failed too: shrink
        bottom = min(points)
        return None if bottom <= cfg.min_rate else max(cfg.min_rate, bottom / 2)
    if hi <= lo * (1 + cfg.rel_tol):
        return None
    return (lo + hi) / 2


def search(measure: Callable[[float, int], list[bool]], cfg: SearchConfig, log=None) -> dict:
    """Run the search. `measure(rate, step)` serves one run at `rate` (step: 0, 1, ... for its seed)
    and returns each request's flag (met both SLOs). Returns goodput_req_s, the interval, the
    bracket and every step (rate, requests, attainment) in the order measured."""
    flags_at: dict[float, list[bool]] = {}
    steps = []
    for step in range(cfg.steps):
        rate = next_rate({r: attainment(f) for r, f in flags_at.items()}, cfg)
        if rate is None:
            break
        flags = list(measure(rate, step))
        flags_at[rate] = flags
        steps.append({"rate": rate, "requests": len(flags), "attainment": attainment(flags),
                      "passed": attainment(flags) >= cfg.target})
        if log:
            log(f"  goodput search step {step + 1}: {rate:.3g} req/s, attainment "
                f"{100 * attainment(flags):.0f}% ({'pass' if steps[-1]['passed'] else 'fail'})")
    return summarize_points(flags_at, cfg, steps)


def summarize_points(flags_at: dict[float, list[bool]], cfg: SearchConfig, steps: list[dict]) -> dict:
    """The goodput of per-request SLO flags at each rate measured (a search's, or fixed rates'):
    goodput_req_s, ci, ci_method, bracket, target, steps, monotonic (every rate at or below the
    goodput passed and every one at or above the bracket's failing end failed), converged."""
    points = {r: attainment(f) for r, f in flags_at.items()}
    lo, hi = _bracket(points, cfg.target)
    goodput = lo or 0.0
    ci = interval(flags_at, goodput, cfg)
    monotonic = all(a >= cfg.target for r, a in points.items() if r <= goodput) and \
        all(a < cfg.target for r, a in points.items() if hi is not None and r >= hi)
    return {"goodput_req_s": goodput, "ci": ci, "ci_method": CI_METHOD, "bracket": [lo, hi],
            "target": cfg.target, "steps": steps, "monotonic": monotonic,
            "converged": hi is not None and lo is not None and hi <= lo * (1 + cfg.rel_tol)}


def attainment_interval(flags: list[bool], cfg: SearchConfig) -> tuple[float, float]:
    """The bootstrap `confidence` interval of a run's attainment."""
    if not flags:
        return 0.0, 0.0
    rng = np.random.default_rng(cfg.seed)
    arr = np.asarray(flags, dtype=float)
    means = arr[rng.integers(0, len(arr), size=(cfg.draws, len(arr)))].mean(axis=1)  # (draws,)
    tail = 100 * (1 - cfg.confidence) / 2
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return float(lo), float(hi)


def interval(flags_at: dict[float, list[bool]], goodput: float, cfg: SearchConfig) -> list:
    """[low, high] of the goodput (see the module doc); high None when no rate surely failed."""
    bounds = {r: attainment_interval(f, cfg) for r, f in flags_at.items()}
    sure_pass = [r for r, (lo, _) in bounds.items() if r <= goodput and lo >= cfg.target]
    sure_fail = [r for r, (_, hi) in bounds.items() if r > goodput and hi < cfg.target]
    return [max(sure_pass) if sure_pass else 0.0, min(sure_fail) if sure_fail else None]


def tie(a: list, b: list) -> bool:
    """Whether two goodput intervals ([low, high], high None: unbounded) overlap. An interval's low
    end is a rate that surely passed and its high end one that surely failed, so the goodput lies in
    [low, high): two intervals that only touch (one's low end is the other's high end: at that rate
    one surely passed and the other surely failed) are separated, not a tie."""
    a_hi = math.inf if a[1] is None else a[1]
    b_hi = math.inf if b[1] is None else b[1]
    return a[0] < b_hi and b[0] < a_hi
