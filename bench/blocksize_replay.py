"""The engine side of `pdserve bench blocksize`: its three request traces and their replay on a
real `LLMEngine`. The mixed-length trace is generated (seeded) as a simulator `Scenario`, so the
allocator simulator (`allocsim`, run by `simulate`) and the engine replay the same requests;
`engine_trace` gives each simulator request one extra prompt token, because the simulator books a
generated token's slot in the step that produces it and the engine one step later (never the last
one's): with prompt + 1 tokens and max_tokens = output the engine's tables hold the simulator's
live count at every step. `shared_trace` builds groups of n > 1 requests behind common prefixes
(engine only; the simulator does not model sharing). `replay` drives the engine step by step:
arrivals are engine steps, a request whose prompt blocks are not free on arrival is rejected (as
in the simulator), and right after each step's schedule it records reserved slots (used blocks x
B) and waste (reserved minus the tokens those blocks hold, a shared block counted once). Allocator
calls and attention are timed by wrappers on the engine's allocator instance and on each layer's
backend `forward` (bench side only: kvcache/ and engine/ are unchanged).
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time
from dataclasses import dataclass

from kvcache.table import blocks_for


@dataclass(frozen=True)
class TraceRequest:
    """One request replayed on the engine.

    arrival: engine step at which it arrives. prompt: its token ids. max_tokens: tokens it
    generates (EOS ignored). n: parallel samples forked from the prompt (sharing its blocks).
    """

    arrival: int
    prompt: tuple[int, ...]
    max_tokens: int
    n: int = 1



def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


def mixed_scenario(cfg):
    """The mixed-length trace (cfg: a `bench.blocksize.BlocksizeConfig`) as a simulator Scenario."""
    from allocsim.scenario import Request, Scenario

    rng, t, reqs = random.Random(cfg.seed), 0, []
    for i in range(cfg.mixed_requests):
        out = _log_uniform(rng, *cfg.mixed_output)
        reqs.append(Request(f"m{i}", t, _log_uniform(rng, *cfg.mixed_prompt), 2 * out, out))
        t += round(rng.expovariate(1 / cfg.mixed_gap))
    return Scenario(cfg.capacity_tokens, tuple(cfg.sizes), tuple(reqs), "mixed lengths")


def engine_trace(scenario, vocab: int, seed: int) -> list[TraceRequest]:
    """A simulator scenario as engine requests: prompt + 1 random token ids (see the module doc)."""
    rng = random.Random(seed)
    return [TraceRequest(r.arrival, tuple(rng.randrange(3, vocab) for _ in range(r.prompt + 1)), r.output)
            for r in scenario.requests]


def shared_trace(cfg, vocab: int) -> list[TraceRequest]:
    """Groups of requests behind one common prefix each, n samples per request, groups interleaved."""
    rng = random.Random(cfg.seed + 1)
    prefixes = [[rng.randrange(3, vocab) for _ in range(cfg.shared_prefix)] for _ in range(cfg.shared_groups)]
    out = []
    for i in range(cfg.shared_requests):
        suffix = [rng.randrange(3, vocab) for _ in range(rng.randint(*cfg.shared_suffix))]
        out.append(TraceRequest(3 * i, tuple(prefixes[i % cfg.shared_groups] + suffix), cfg.shared_output,
                                cfg.shared_n))
    return out


def simulate(scenario, block_size: int) -> dict:
    """The simulator's paged policy on `scenario` at one block size (no blocks: all rejected)."""
    from allocsim.policies import Paged
    from allocsim.run import run_policy

    if scenario.capacity < block_size:
        return {"admitted": 0, "rejected": len(scenario.requests), "growth_failures": 0, "peak_waste": 0,
                "peak_reserved": 0, "waste_series": [], "note": "pool smaller than one block"}
    sc = dataclasses.replace(scenario, block_sizes=(block_size,))
    r = run_policy(sc, Paged(scenario.capacity, block_size))
    return {"admitted": r.admitted, "rejected": r.rejected, "growth_failures": r.growth_failures,
            "peak_waste": r.peak_waste, "peak_reserved": r.peak_reserved,
            "waste_series": [s.waste for s in r.series]}


# ---- instrumentation ---------------------------------------------------------------------------
class Timer:
    """Seconds and calls of the outermost wrapped calls (nested wrapped calls are not re-timed)."""

    def __init__(self) -> None:
        self.seconds, self.calls, self._depth = 0.0, 0, 0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
                self._depth -= 1
        return timed


ALLOCATOR_METHODS = ("allocate", "allocate_many", "free", "free_many", "incref", "acquire_cached", "register",
                     "lookup")


def instrument(eng) -> tuple[Timer, Timer, object]:
    """Wrap the engine's allocator methods and each layer's attention forward (instance attributes
    only; kvcache/ and engine/ are unchanged). Returns (allocator timer, attention timer, undo):
    `undo()` puts the layers' backends back (the model may be shared by later engines)."""
    alloc_t, attn_t = Timer(), Timer()
    for name in ALLOCATOR_METHODS:
        setattr(eng.kv.allocator, name, alloc_t.wrap(getattr(eng.kv.allocator, name)))
    saved = [(layer.self_attn, layer.self_attn.backend) for layer in eng.model.layers]
    for attn, backend in saved:
        attn.backend = dataclasses.replace(backend, forward=attn_t.wrap(backend.forward))

    def undo() -> None:
        for attn, backend in saved:
            attn.backend = backend
    return alloc_t, attn_t, undo


def waste_now(kv) -> tuple[int, int]:
    """(reserved slots, waste slots) of resident tables: used blocks x B, minus the tokens they hold
    (only a table's tail block is partly filled; a shared tail is counted once)."""
    B = kv.block_size
    tails = {}
    for t in kv.tables.values():
        if not t.swapped and t.num_tokens % B:
            tails[t.blocks[-1]] = B - t.num_tokens % B
    return kv.allocator.num_used * B, sum(tails.values())


# ---- one replay --------------------------------------------------------------------------------
def replay(eng, trace: list[TraceRequest], max_steps: int = 100_000) -> dict:
    """Replay `trace` on a fresh engine; returns the counts and timings of the module doc."""
    alloc_t, attn_t, undo = instrument(eng)
    try:
        return _replay(eng, trace, alloc_t, attn_t, max_steps)
    finally:
        undo()


def _replay(eng, trace: list[TraceRequest], alloc_t: Timer, attn_t: Timer, max_steps: int) -> dict:
    from engine.engine import RequestError
    from engine.sampling import SamplingParams

    kv, sched = eng.kv, eng.scheduler
    peak = {"reserved": 0, "waste": 0}
    series: list[int] = []
    hit0, asked = kv.prefix_hit_tokens, [0]
    orig_schedule, orig_allocate = sched.schedule, kv.allocate

    def schedule():  # measure right after the plan reserved this step's slots
        plan = orig_schedule()
        reserved, waste = waste_now(kv)
        peak["reserved"], peak["waste"] = max(peak["reserved"], reserved), max(peak["waste"], waste)
        series.append(waste)
        return plan

    def allocate(seq_id, token_ids, extra_key=None):
        asked[0] += len(token_ids)
        return orig_allocate(seq_id, token_ids, extra_key)

    sched.schedule, kv.allocate = schedule, allocate
    counts = {"admitted": 0, "rejected": 0}
    first, last, ntok = {}, {}, {}
    decode_attn, decode_steps, prefill_attn, prefill_tokens, alloc_s, alloc_calls = 0.0, 0, 0.0, 0, 0.0, 0
    cow0, pre0, steps, t = kv.cow_copies, sched.preemptions, 0, 0
    pending = sorted(trace, key=lambda r: r.arrival)
    t0 = time.perf_counter()
    while pending or eng.has_work():
        while pending and pending[0].arrival <= t:
            r = pending.pop(0)
            if blocks_for(len(r.prompt), kv.block_size) > kv.allocator.num_available:
                counts["rejected"] += 1
                continue
            sp = SamplingParams(max_tokens=r.max_tokens, n=r.n, ignore_eos=True,
                                temperature=0.8 if r.n > 1 else 0.0, seed=t)
            try:
                eng.add_request(list(r.prompt), sp)
            except RequestError:
                counts["rejected"] += 1
                continue
            counts["admitted"] += 1
        a0, c0, at0, s0 = alloc_t.seconds, alloc_t.calls, attn_t.seconds, eng.steps
        outs = eng.step()
        now = time.perf_counter()
        t += 1
        if t > max_steps:
            raise RuntimeError(f"trace did not finish within {max_steps} steps")
        if eng.steps == s0:  # nothing scheduled (idle until the next arrival)
            continue
        steps += 1
        alloc_s, alloc_calls = alloc_s + alloc_t.seconds - a0, alloc_calls + alloc_t.calls - c0
        if eng.last_step_prefill_tokens:
            prefill_attn += attn_t.seconds - at0
            prefill_tokens += eng.last_step_prefill_tokens
        else:
            decode_attn += attn_t.seconds - at0
            decode_steps += 1
        for o in outs:
            key = (o.request_id, o.index)
            first.setdefault(key, now)
            last[key] = now
            ntok[key] = ntok.get(key, 0) + len(o.new_token_ids)
    wall = time.perf_counter() - t0
    tpots = [(last[k] - first[k]) / (ntok[k] - 1) for k in ntok if ntok[k] > 1]
    block_bytes = eng.storage.layout.block_bytes
    return {**counts, "requests": len(trace), "completed": counts["admitted"] - len(eng.requests),
            "preemptions": sched.preemptions - pre0, "peak_reserved": peak["reserved"],
            "peak_waste": peak["waste"], "waste_series": series, "steps": steps, "wall_s": wall,
            "output_tokens": sum(ntok.values()), "tokens_per_s": sum(ntok.values()) / wall,
            "tpot_ms": 1e3 * statistics.fmean(tpots) if tpots else None,
            "alloc_calls_per_step": alloc_calls / max(1, steps),
            "alloc_us_per_step": 1e6 * alloc_s / max(1, steps),
            "attn_ms_per_step": 1e3 * decode_attn / decode_steps if decode_steps else None,
            "attn_ms_per_prefill_token": 1e3 * prefill_attn / prefill_tokens if prefill_tokens else None,
            "cow_bytes": (kv.cow_copies - cow0) * block_bytes,
            "prefix_hit_rate": (kv.prefix_hit_tokens - hit0) / asked[0] if asked[0] else 0.0}
