"""Open-loop load for the serving benchmark: what to send, when, and what the client saw.

A `Workload` (rate, request count, prompt and output length distributions, seed) becomes a list
of `RequestSpec`s: Poisson arrivals (exponential gaps at `rate` requests/s from a seeded numpy
RNG; rate inf sends everything at once), prompts as token-id lists drawn from printable bytes
(the tiny model's byte vocabulary, so a prompt of N ids is exactly N tokens and never hits
BOS/EOS), and output lengths the server is held to exactly (temperature 0, ignore_eos,
max_tokens). `run_load` sends them over one aiohttp session at their arrival times, never
waiting for earlier answers (open loop), streams each answer (server-sent events) and records
per request, client side: send time, every chunk's arrival time and token count, first-token
and end time, plus what the server reported in its last chunk (its TTFT and the KV migration's
ms; for a streamed migration, whose ms is only the part after the prefill finished, also the
streamed ms and the share of the payload sent before it finished). `run_load(sequential=True)`
sends one request at a time instead. Every request has a timeout; a failed one is recorded with
its error, never raised. `measure.serve_client` runs this in a process of its own.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field

import numpy as np

DISTRIBUTIONS = ("fixed", "uniform", "lognormal")
PROMPT_ID_RANGE = (32, 127)  # printable ASCII: plain bytes for the byte-level tiny model


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution. kind: 'fixed' (always `mean`), 'uniform' (integers in
    [low, high]) or 'lognormal' (median `mean`, log-space spread `sigma`, clipped to
    [low, high]). Every sample is at least 1."""

    kind: str = "fixed"
    mean: int = 128
    low: int = 1
    high: int = 1024
    sigma: float = 0.4

    def __post_init__(self) -> None:
        if self.kind not in DISTRIBUTIONS:
            raise ValueError(f"length distribution must be one of {DISTRIBUTIONS}, got {self.kind!r}")
        if self.mean < 1 or self.low < 1 or self.high < self.low:
            raise ValueError(f"bad length bounds: mean {self.mean}, low {self.low}, high {self.high}")
        if self.sigma < 0:
            raise ValueError(f"sigma must be >= 0, got {self.sigma}")

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.kind == "fixed":
            vals = np.full(n, self.mean)
        elif self.kind == "uniform":
            vals = rng.integers(self.low, self.high + 1, size=n)
        else:
            vals = np.rint(rng.lognormal(math.log(self.mean), self.sigma, size=n))
            vals = np.clip(vals, self.low, self.high)
        return [max(1, int(v)) for v in vals]


@dataclass(frozen=True)
class Workload:
    """rate: requests/s of the Poisson arrivals (math.inf: all at t=0). num_requests: how many.
    prompt_len / output_len: length distributions. seed: the RNG seed (arrivals, lengths and
    prompt ids all follow from it)."""

    rate: float
    num_requests: int
    prompt_len: LengthDist
    output_len: LengthDist
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")


# Where prefill interference shows (long prompts stall the decode steps they share an engine
# with: long-prompt-long-output, DistServe's case), the prefill-heavy case with short answers and the
# decode-heavy opposite. Prompts stay within the tiny model's 2,048-token context with their outputs.
PRESETS: dict[str, tuple[LengthDist, LengthDist]] = {
    "long-prompt-long-output": (LengthDist("lognormal", mean=768, low=256, high=1536, sigma=0.35),
                                LengthDist("uniform", mean=128, low=96, high=160)),
    "long-prompt-short-output": (LengthDist("lognormal", mean=768, low=256, high=1536, sigma=0.35),
                                 LengthDist("uniform", mean=16, low=8, high=24)),
    "short-prompt-long-output": (LengthDist("uniform", mean=48, low=16, high=96),
                                 LengthDist("uniform", mean=96, low=64, high=128)),
}


def preset(name: str, rate: float, num_requests: int, seed: int = 0) -> Workload:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    p, o = PRESETS[name]
    return Workload(rate, num_requests, p, o, seed)


@dataclass(frozen=True)
class RequestSpec:
    """One request: when to send it (s after the run starts), its prompt ids and max_tokens."""

    index: int
    arrival_s: float
    prompt: list[int]
    max_tokens: int


def arrival_times(rate: float, n: int, rng: np.random.Generator) -> list[float]:
    """Poisson process: cumulative exponential gaps of mean 1/rate; the first request at t=0."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = rng.exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]


def make_requests(w: Workload) -> list[RequestSpec]:
    rng = np.random.default_rng(w.seed)
    times = arrival_times(w.rate, w.num_requests, rng)
    plens = w.prompt_len.sample(rng, w.num_requests)
    olens = w.output_len.sample(rng, w.num_requests)
    lo, hi = PROMPT_ID_RANGE
    return [RequestSpec(i, times[i], [int(x) for x in rng.integers(lo, hi, size=plens[i])], olens[i])
            for i in range(w.num_requests)]


@dataclass
class RequestRecord:
    """What the client saw of one request (times in seconds on the client's monotonic clock)."""

    index: int
    prompt_tokens: int
    max_tokens: int
    send_s: float = 0.0
    first_s: float | None = None
    end_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    output_tokens: int = 0
    ok: bool = False
    error: str | None = None
    server_ttft_ms: float | None = None
    migration_ms: float | None = None  # streamed: only the exposed part (after the prefill finished)
    streamed_ms: float | None = None  # streamed migrations: offer to final message (alongside the prefill)
    overlap_pct: float | None = None  # streamed migrations: % of payload bytes sent before the prefill ended
    cached_tokens: int | None = None  # prompt tokens the prefix cache gave (None: the server did not say)
    worker: str | None = None  # the worker that prefilled it (the response's pdserve.backend)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _chunk_tokens(chunk: dict) -> int:
    return sum(len(c.get("token_ids") or []) for c in chunk.get("choices") or [])


async def _one(session, url: str, model: str, spec: RequestSpec, t0: float, timeout_s: float,
               extra: dict) -> RequestRecord:
    import aiohttp

    rec = RequestRecord(spec.index, len(spec.prompt), spec.max_tokens)
    delay = t0 + spec.arrival_s - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    body = {"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, **extra}
    rec.send_s = time.monotonic()
    last: dict = {}
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                rec.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return rec
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec.error = f"stream error: {chunk['error'].get('message')}"
                    return rec
                now, n = time.monotonic(), _chunk_tokens(chunk)
                if n and rec.first_s is None:
                    rec.first_s = now
                if n:
                    rec.chunk_s.append(now)
                    rec.chunk_tokens.append(n)
                    rec.output_tokens += n
                last = chunk
        rec.end_s = time.monotonic()
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    timing = last.get("pdserve") or {}
    rec.server_ttft_ms = timing.get("ttft_ms")
    rec.cached_tokens = timing.get("cached_tokens")
    backend = timing.get("backend") or {}
    rec.worker = backend.get("worker") or backend.get("prefill_worker")
    mig = backend.get("migration") or {}
    rec.migration_ms = float(mig["ms"]) if "ms" in mig else None
    phases = mig.get("phases") or {}
    if "overlap_pct" in phases:  # a streamed migration
        rec.overlap_pct = float(phases["overlap_pct"])
        rec.streamed_ms = float(phases.get("streamed_ms", 0.0))
    if rec.output_tokens != spec.max_tokens:
        rec.error = f"got {rec.output_tokens} tokens, asked for exactly {spec.max_tokens}"
    else:
        rec.ok = True
    return rec


async def run_load(base_url: str, specs: list[RequestSpec], model: str = "", timeout_s: float = 120.0,
                   progress=None, extra: dict | None = None,
                   sequential: bool = False) -> tuple[list[RequestRecord], float]:
    """Send `specs` open loop; returns the records (in spec order) and the run's duration (s, first
    send to last answer). `progress(record)` is called as each request ends. sequential: one at a
    time instead, each sent when the one before it ended (arrival times ignored)."""
    import aiohttp

    url = base_url.rstrip("/") + "/v1/completions"
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        t0 = time.monotonic()

        async def tracked(spec: RequestSpec, start: float) -> RequestRecord:
            rec = await _one(session, url, model, spec, start, timeout_s, extra or {})
            if progress is not None:
                progress(rec)
            return rec

        if sequential:
            records = [await tracked(s, time.monotonic() - s.arrival_s) for s in specs]
        else:
            records = await asyncio.gather(*(tracked(s, t0) for s in specs))
    ends = [r.end_s for r in records if r.end_s is not None]
    return list(records), (max(ends) if ends else time.monotonic()) - t0
