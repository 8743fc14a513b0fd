"""Generate the small Mooncake-format trace shipped as measure/traces/small.jsonl (seeded: the same
file every time). `python -m measure.traces.generate [--out FILE] [--requests N] [--rate R] [--seed S]`.

What it holds: Poisson arrivals (ms timestamps) at `rate` requests/s. Every request starts with one
of NUM_SYSTEM system-prompt blocks (hash ids 0..NUM_SYSTEM-1, so requests share 512-token
prefixes); a FOLLOW_UP share of them continue an earlier request instead (its whole hash id list,
then blocks of their own: a multi-turn conversation, the longer prefix shared); the rest add 0-2
blocks of their own. The last block is partial (input_length cut inside it), inputs stay within
MAX_INPUT tokens (the tiny model's 2,048-token context less the longest output), outputs are
lognormal around 48 tokens within 8..160, the way Mooncake's conversation trace mixes long prompts
with short answers.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from measure.serve_trace import BLOCK_TOKENS

NUM_SYSTEM = 3
FOLLOW_UP = 0.3
MAX_INPUT = 1800
OUTPUT = (48, 8, 160)  # median, low, high
DEFAULT_PATH = os.path.join(os.path.dirname(__file__), "small.jsonl")


def generate(requests: int = 120, rate: float = 1.0, seed: int = 0) -> list[dict]:
    """The trace's records (dicts in Mooncake's field order), in arrival order."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1000.0 / rate, size=requests)
    gaps[0] = 0.0
    times = np.cumsum(gaps)
    next_id, out = NUM_SYSTEM, []
    for i in range(requests):
        parent = out[int(rng.integers(0, len(out)))] if out and rng.random() < FOLLOW_UP else None
        base = list(parent["hash_ids"]) if parent else [int(rng.integers(0, NUM_SYSTEM))]
        own = int(rng.integers(1, 3)) if parent else int(rng.integers(0, 3))
        ids = base + list(range(next_id, next_id + own))
        ids = ids[:MAX_INPUT // BLOCK_TOKENS + 1]
        next_id += own
        full = (len(ids) - 1) * BLOCK_TOKENS  # the last block is partial: cut somewhere inside it
        n_in = min(MAX_INPUT, full + int(rng.integers(16, BLOCK_TOKENS + 1)))
        ids = ids[:-(-n_in // BLOCK_TOKENS)]
        median, lo, hi = OUTPUT
        n_out = int(np.clip(np.rint(rng.lognormal(np.log(median), 0.6)), lo, hi))
        out.append({"timestamp": int(times[i]), "input_length": n_in, "output_length": n_out,
                    "hash_ids": ids})
    return out


def write(records: list[dict], path: str) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=DEFAULT_PATH)
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--rate", type=float, default=1.0, help="mean requests/s of the timestamps")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    write(generate(a.requests, a.rate, a.seed), a.out)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
