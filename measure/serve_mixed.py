"""The per-request mode's pieces of `pdserve bench serve`: the paths a coordinator counted
(`path_counts`, from /metrics) and the `mixed` workload, the case a per-request decision is for. Poisson
arrivals of three kinds of request in equal shares, drawn from one seed: short prompts (16-64
tokens, which a migration's fixed cost dominates), long prompts (512-1024 tokens, which disaggregation
keeps off the decode batch), and prompts sharing one of two long prefixes (512 tokens, then 16-48
tokens of their own: after the first of each, the decode worker caches the prefix). Outputs are
8-32 tokens. The shared prefixes differ per seed, so runs of one invocation never hit each other's
cache.
"""

from __future__ import annotations

import numpy as np

from measure.loadgen import PROMPT_ID_RANGE, RequestSpec, arrival_times

NAME = "mixed"
SHORT = (16, 64)
LONG = (512, 1024)
PREFIX = 512
SUFFIX = (16, 48)
OUTPUT = (8, 32)
NUM_PREFIXES = 2


def mixed_requests(rate: float, n: int, seed: int) -> list[RequestSpec]:
    rng = np.random.default_rng(seed)
    times = arrival_times(rate, n, rng)
    lo, hi = PROMPT_ID_RANGE

    def ids(k: int) -> list[int]:
        return [int(x) for x in rng.integers(lo, hi, size=k)]

    prefixes = [ids(PREFIX) for _ in range(NUM_PREFIXES)]
    out = []
    for i in range(n):
        kind = rng.integers(0, 3)
        if kind == 0:
            prompt = ids(int(rng.integers(SHORT[0], SHORT[1] + 1)))
        elif kind == 1:
            prompt = ids(int(rng.integers(LONG[0], LONG[1] + 1)))
        else:
            prefix = prefixes[int(rng.integers(0, NUM_PREFIXES))]
            prompt = prefix + ids(int(rng.integers(SUFFIX[0], SUFFIX[1] + 1)))
        out.append(RequestSpec(i, times[i], prompt, int(rng.integers(OUTPUT[0], OUTPUT[1] + 1))))
    return out


def path_counts(url: str) -> dict[str, float]:
    """pdserve_requests_by_path_total per 'path/reason' from the coordinator's /metrics ({} if none)."""
    import re
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    pattern = r'^pdserve_requests_by_path_total\{path="([^"]+)",reason="([^"]+)"\} (\S+)$'
    return {f"{m[1]}/{m[2]}": float(m[3]) for m in re.finditer(pattern, text, re.M)}
