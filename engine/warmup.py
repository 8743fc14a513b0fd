"""An engine's warm-up at worker start: two dummy prompts run to two tokens each, so the first real
request does not pay the engine's one-time costs. Measured on fresh tiny engines here (2 cores): a
28-token prompt took 4.6-40 ms as the engine's first request against 2.2-2.9 ms after a warm-up,
a first 1004-token prompt 24-72 ms against 16.6-18.4. `pdserve plan --validate` caught it as the
second colocated worker's first request, 24.5 ms at the server where the model said 9.5
(least-loaded routing sends a cluster's first requests, the bench's warm-up included, to the
first worker). The prompts are a short one (two blocks) and one of a step's budget up to
LONG_MAX tokens (the workspace grows to a whole chunk once), capped by the pool and the model's
context, in one batch so a decode step of two rows runs too: 11 ms on tiny, 0.5-0.7 s on SmolLM2
here. Prefix caching is off while they run, so no block they filled can ever serve a real prompt;
every block goes back, and the step counter and the step pacer (engine.step_pacer) start as if
nothing had run (the pacer's first observations would otherwise be the cold step's).
`startup_profile` runs the same prompts once more, warm, and times each step: the prefill step's
ms per token and the two-row decode step's ms, what coordinator.decide needs to price a local
prefill on this worker (a second pass: the first one's times are the cold costs it absorbs).
"""

from __future__ import annotations

import time

from engine.step_pacer import StepPacer
from protocol.sampling import SamplingParams

LONG_MAX = 512  # tokens of the longer prompt at most: a 2,016-token one took 3.4 s on SmolLM2 here


def warmup_prompts(engine) -> list[list[int]]:
    """The two dummy prompts for `engine`: token ids 1.. cycled below the vocabulary."""
    c, m, s = engine.config, engine.model_config, engine.scheduler.config
    vocab = max(2, min(m.vocab_size, 256))
    cap = min(s.max_num_batched_tokens - 2 * c.block_size, LONG_MAX, m.max_position_embeddings - 4,
              (c.num_blocks // 2 - 2) * c.block_size)
    lengths = sorted({n for n in (2 * c.block_size, cap) if n >= 1})
    return [[1 + (i * 7) % (vocab - 1) for i in range(n)] for n in lengths]


def warm_up(engine) -> float:
    """Run the warm-up prompts through `engine` (any role, before it takes a request); seconds."""
    return _run(engine, [])


def startup_profile(engine) -> dict:
    """The warm-up prompts again on a warmed `engine`, each step timed: prefill_ms_per_token (the
    prefill steps' ms over their prompt tokens), prefill_tokens, decode_step_ms (the median step
    without prefill tokens; None if none ran) and seconds in all."""
    steps: list[tuple[float, int]] = []  # (ms, prefill tokens) per step
    seconds = _run(engine, steps)
    pre = [(ms, n) for ms, n in steps if n > 0]
    dec = sorted(ms for ms, n in steps if n == 0)
    tokens = sum(n for _, n in pre)
    return {"prefill_ms_per_token": sum(ms for ms, _ in pre) / tokens if tokens else None,
            "prefill_tokens": tokens, "decode_step_ms": dec[len(dec) // 2] if dec else None,
            "seconds": seconds}


def _run(engine, timings: list) -> float:
    """The warm-up prompts to their end, appending (ms, prefill tokens) per step to `timings`."""
    t0 = time.perf_counter()
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    kv, steps = engine.kv, engine.steps
    caching, kv.enable_prefix_caching = kv.enable_prefix_caching, False
    ids = []
    try:
        ids = [engine.add_request(p, params, request_id=f"pdserve-warmup-{i}")
               for i, p in enumerate(warmup_prompts(engine))]
        for _ in range(10_000):  # a bound: two prompts of at most a step's budget finish in a few
            if not engine.has_work():
                break
            t = time.perf_counter()
            engine.step()
            timings.append(((time.perf_counter() - t) * 1e3, engine.last_step_prefill_tokens))
    finally:
        for rid in ids:  # a prefill role still holds a finished one's blocks for migration; others: a no-op
            engine.abort(rid)
        kv.enable_prefix_caching = caching
        engine.steps = steps
        old = engine.scheduler.pacer
        engine.scheduler.pacer = StepPacer(old.target_s, old.max_tokens, old.decay)
    return time.perf_counter() - t0
