"""The planner's workload: requests with an arrival time, prompt and output lengths, and an optional
shared prefix (id and length: its full blocks are one cached chain wherever it was prefilled). From a
trace JSON (a list, or {"requests": [...]}, of {"arrival_s", "prompt_tokens", "output_tokens",
optional "prefix_id", "prefix_tokens"}) or a Mooncake JSONL trace (measure.serve_trace: a request's
prefix is the longest run of leading hash ids it shares with another request, one block of 512
tokens per id, named by those ids), from length distributions and a Poisson rate (measure.loadgen's
LengthDist and presets), or from `bench serve`'s own request specs (shared prefixes found by their
first tokens). `at_rate` rescales a trace's arrivals to another mean rate.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np

from measure.loadgen import PRESETS, LengthDist, arrival_times


@dataclass(frozen=True)
class Req:
    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_id: str | None = None   # requests naming the same id share their first prefix_tokens tokens
    prefix_tokens: int = 0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1 or self.arrival_s < 0:
            raise ValueError(f"request {self.index}: prompt and output must be >= 1, arrival >= 0")
        if not 0 <= self.prefix_tokens <= self.prompt_tokens:
            raise ValueError(f"request {self.index}: prefix_tokens must be within the prompt")


def load_trace(path: str) -> list[Req]:
    """The planner's trace JSON, or a Mooncake JSONL trace (recognised by its first line)."""
    from measure.serve_trace import is_mooncake, read_mooncake

    if is_mooncake(path):
        return from_mooncake(read_mooncake(path))
    with open(path) as f:
        data = json.load(f)
    rows = data["requests"] if isinstance(data, dict) else data
    out = [Req(i, float(r["arrival_s"]), int(r["prompt_tokens"]), int(r["output_tokens"]),
               r.get("prefix_id"), int(r.get("prefix_tokens", 0))) for i, r in enumerate(rows)]
    return sorted(out, key=lambda r: r.arrival_s)


def from_mooncake(records) -> list[Req]:
    """measure.serve_trace records as planner requests. The planner knows one shared prefix per
    request: its longest run of leading hash ids that another request also starts with (the full
    blocks of it, cut to the prompt), named by those ids, so requests sharing it share the same
    id. A request sharing two different depths with two others keeps the deeper one only."""
    from measure.serve_trace import BLOCK_TOKENS

    starts = Counter(r.hash_ids[:k] for r in records for k in range(1, len(r.hash_ids) + 1))
    out = []
    for i, r in enumerate(records):
        k = max((k for k in range(1, len(r.hash_ids) + 1) if starts[r.hash_ids[:k]] > 1), default=0)
        tokens = min(k * BLOCK_TOKENS, r.input_length)
        pid = "h" + "-".join(map(str, r.hash_ids[:k])) if k else None
        out.append(Req(i, (r.timestamp_ms - records[0].timestamp_ms) / 1000.0, r.input_length,
                       r.output_length, pid, tokens if pid else 0))
    return out


def mean_rate(reqs: list[Req]) -> float:
    span = max(r.arrival_s for r in reqs) - min(r.arrival_s for r in reqs)
    return (len(reqs) - 1) / span if span > 0 else float("inf")


def at_rate(reqs: list[Req], rate: float) -> list[Req]:
    """The trace with its arrival times scaled so its mean rate is `rate` (req/s)."""
    scale = mean_rate(reqs) / rate
    t0 = min(r.arrival_s for r in reqs)
    return [replace(r, arrival_s=(r.arrival_s - t0) * scale) for r in reqs]


def from_distributions(prompt: LengthDist, output: LengthDist, rate: float, n: int,
                       seed: int = 0) -> list[Req]:
    rng = np.random.default_rng(seed)
    times = arrival_times(rate, n, rng)
    plens, olens = prompt.sample(rng, n), output.sample(rng, n)
    return [Req(i, times[i], plens[i], olens[i]) for i in range(n)]


def from_preset(name: str, rate: float, n: int, seed: int = 0) -> list[Req]:
    """measure.loadgen's presets, or 'mixed' (measure.serve_mixed: shared prefixes included)."""
    if name == "mixed":
        from measure.serve_mixed import mixed_requests

        return from_specs(mixed_requests(rate, n, seed))
    p, o = PRESETS[name]
    return from_distributions(p, o, rate, n, seed)


def from_specs(specs, prefix_probe: int = 512) -> list[Req]:
    """bench serve's RequestSpecs: prompts whose first `prefix_probe` tokens recur share a prefix."""
    key = lambda s: tuple(s.prompt[:prefix_probe])  # noqa: E731
    counts = Counter(key(s) for s in specs if len(s.prompt) > prefix_probe)
    ids = {k: f"p{i}" for i, k in enumerate(k for k, c in counts.items() if c > 1)}
    out = []
    for s in specs:
        pid = ids.get(key(s)) if len(s.prompt) > prefix_probe else None
        out.append(Req(s.index, s.arrival_s, len(s.prompt), s.max_tokens, pid, prefix_probe if pid else 0))
    return out


def parse_dist(text: str) -> LengthDist:
    """'fixed:128', 'uniform:16:96' or 'lognormal:768:256:1536[:sigma]' -> LengthDist."""
    kind, *nums = text.split(":")
    if kind == "fixed":
        return LengthDist("fixed", mean=int(nums[0]), low=1, high=max(1, int(nums[0])))
    if kind == "uniform":
        lo, hi = int(nums[0]), int(nums[1])
        return LengthDist("uniform", mean=(lo + hi) // 2, low=lo, high=hi)
    if kind == "lognormal":
        sigma = float(nums[3]) if len(nums) > 3 else 0.4
        return LengthDist("lognormal", mean=int(nums[0]), low=int(nums[1]), high=int(nums[2]), sigma=sigma)
    raise ValueError(f"length distribution {text!r}: use fixed:N, uniform:LO:HI or "
                     "lognormal:MEDIAN:LO:HI[:SIGMA]")
