"""Replay of a Mooncake-format trace (the JSONL that Mooncake publishes and AIPerf and Dynamo's
simulator read): one JSON object per line, `timestamp` (ms since the trace began), `input_length`
and `output_length` (tokens) and `hash_ids`, one id per BLOCK_TOKENS-token block of the prompt.

A hash id stands for a block of fixed token content derived from the id alone (and a `salt`), so
two requests naming the same leading ids share that prefix token for token, and a server's prefix
cache sees exactly the sharing the trace describes. The last block is cut to `input_length`.
`salt` changes every block's content at once: each run of one invocation replays the trace with
its own salt, so no run hits the prefix cache another run filled.

The time scale fits the trace's rate to this machine: arrival = (timestamp - first) / 1000 *
time_scale, so 2.0 replays the trace at half its rate; `scale_for_rate` gives the scale that
makes the mean rate a given one (the goodput search replays the trace at each rate it tries).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from measure.loadgen import PROMPT_ID_RANGE, RequestSpec

BLOCK_TOKENS = 512  # tokens one hash id stands for (Mooncake's block)
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """A trace file that is not valid Mooncake JSONL (the message names the line and the field)."""


@dataclass(frozen=True)
class TraceRecord:
    timestamp_ms: float         # when the request arrives, ms after the trace began
    input_length: int           # prompt tokens
    output_length: int          # tokens to generate
    hash_ids: tuple[int, ...]   # one per BLOCK_TOKENS-token block of the prompt, the last one partial


def _record(obj, where: str) -> TraceRecord:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: a trace line must be a JSON object, got {type(obj).__name__}")
    missing = [k for k in FIELDS if k not in obj]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(missing)} (a Mooncake line has {', '.join(FIELDS)})")
    ts, n_in, n_out, ids = (obj[k] for k in FIELDS)
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise TraceError(f"{where}: timestamp must be a finite number of ms >= 0, got {ts!r}")
    for name, v in (("input_length", n_in), ("output_length", n_out)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise TraceError(f"{where}: {name} must be an integer >= 1, got {v!r}")
    if not isinstance(ids, list) or any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in ids):
        raise TraceError(f"{where}: hash_ids must be a list of integers >= 0")
    need = -(-n_in // BLOCK_TOKENS)
    if len(ids) < need:
        raise TraceError(f"{where}: input_length {n_in} needs {need} hash ids of {BLOCK_TOKENS} tokens, "
                         f"got {len(ids)}")
    return TraceRecord(float(ts), n_in, n_out, tuple(ids[:need]))


def read_mooncake(path: str) -> list[TraceRecord]:
    """Every line of a Mooncake JSONL trace (blank lines skipped), sorted by timestamp."""
    out = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{path}:{i}: not JSON: {e.msg}") from None
            out.append(_record(obj, f"{path}:{i}"))
    if not out:
        raise TraceError(f"{path}: no requests")
    return sorted(out, key=lambda r: r.timestamp_ms)


def is_mooncake(path: str) -> bool:
    """Whether `path` looks like a Mooncake trace: its first non-blank line is a JSON object with
    hash_ids (the planner's own trace format is one JSON document)."""
    with open(path) as f:
        for line in f:
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(obj, dict) and "hash_ids" in obj
    return False


def block_tokens(hash_id: int, salt: int = 0) -> list[int]:
    """The BLOCK_TOKENS token ids hash id `hash_id` stands for: the same for the same (id, salt)
    on every machine (numpy's PCG64 seeded by both), printable ids as every bench prompt."""
    lo, hi = PROMPT_ID_RANGE
    rng = np.random.default_rng([int(salt), int(hash_id)])
    return [int(x) for x in rng.integers(lo, hi, size=BLOCK_TOKENS)]


def prompt_tokens(rec: TraceRecord, salt: int = 0) -> list[int]:
    """The record's prompt: its blocks' tokens in order, cut to input_length."""
    out: list[int] = []
    for h in rec.hash_ids:
        out += block_tokens(h, salt)
    return out[:rec.input_length]


def mean_rate(records: list[TraceRecord]) -> float:
    """Requests per second over the trace's span (inf when every request arrives at once)."""
    span_s = (records[-1].timestamp_ms - records[0].timestamp_ms) / 1000.0
    return (len(records) - 1) / span_s if span_s > 0 else math.inf


def scale_for_rate(records: list[TraceRecord], rate: float) -> float:
    """The time scale that replays `records` at a mean of `rate` requests/s."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    r = mean_rate(records)
    return 1.0 if math.isinf(r) else r / rate


def to_specs(records: list[TraceRecord], time_scale: float = 1.0, salt: int = 0,
             limit: int | None = None) -> list[RequestSpec]:
    """The first `limit` records (all: None) as bench requests, arrivals scaled by `time_scale`."""
    if not time_scale > 0 or not math.isfinite(time_scale):
        raise ValueError(f"time scale must be finite and > 0, got {time_scale}")
    recs = records[:limit] if limit is not None else records
    t0 = recs[0].timestamp_ms
    return [RequestSpec(i, (r.timestamp_ms - t0) / 1000.0 * time_scale, prompt_tokens(r, salt),
                        r.output_length) for i, r in enumerate(recs)]
