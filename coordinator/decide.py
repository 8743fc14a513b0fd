"""Per-request placement: prefill on a prefill worker and migrate the KV (`disaggregate`), or
prefill on the decode worker itself (`local_prefill`), as a pure function of what the
coordinator knows when the request arrives (`DecideInputs`). The cost model behind `auto`: the
decode worker's time is the scarce resource (it steps every running sequence). Prefilling L
uncached tokens there costs it about `p * L` ms (p: prefill ms per token, `pdserve profile`);
disaggregating costs it the migration's receiving side, about `m0 + m1 * L` ms, whose fixed
part m0 (handshake round trips, manifests, commit) dominates short prompts. Below the
crossover `L* = m0 / (p - m1)` a local prefill is cheaper for everyone: that crossover, measured
on this machine, is the default `local_prefill_max_tokens` (planner.profile prints it for any
model, block size and device). The prefix the decode worker already caches is not prefilled
again, so only the uncached part counts; each request queued at the prefill worker delays a
remote prefill by about one more prompt, so the limit grows with that queue (at most
`MAX_QUEUE_FACTOR` times); a decode worker with requests already waiting to start is left alone.
Where p comes from: `DecideConfig.prefill_ms_per_token` (from a `pdserve profile` file, see
`from_profile`), else the decode worker's own measurement at startup (engine.warmup times its
warm-up prompts; `DecideInputs.decode_prefill_ms_per_token`), else none (the fixed limit).
The decode worker's batch: a local prefill of L tokens stalls every one of the B sequences it
holds for about `p * L` ms, while a migration delays only the new request, so with B >= 2
running the limit is divided by B (local only while B stalls together cost less than one
migration); with 0 or 1 running it is unchanged.
`reason_kind` is a small closed set (the /metrics label); `reason` is the sentence for the client.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("always", "never", "auto")
PATHS = ("disaggregate", "local_prefill")
MAX_QUEUE_FACTOR = 4  # the prefill queue raises the limit to at most this many times its base


@dataclass(frozen=True)
class DecideInputs:
    prompt_tokens: int               # the prompt (plus tokens already generated) to prefill
    decode_cached_tokens: int = 0    # of those, the ones the decode worker is believed to cache
    prefill_queue_depth: int = 0     # requests waiting to start on the chosen prefill worker
    decode_queue_depth: int = 0      # requests waiting to start on the decode worker
    migration_ms: float | None = None  # mean migration time measured for this transport (None: none yet)
    decode_running: int = 0          # sequences in the decode worker's batch (a local prefill stalls each)
    # the decode worker's prefill ms per token, measured at its startup (engine.warmup); None: not measured
    decode_prefill_ms_per_token: float | None = None


@dataclass(frozen=True)
class DecideConfig:
    mode: str = "always"             # 'always' (disaggregate every request), 'never' or 'auto'
    local_prefill_max_tokens: int = 80   # auto: longest uncached prompt prefilled on the decode worker
    local_prefill_max_waiting: int = 4   # auto: a decode worker with this many waiting requests is busy
    # auto, > 0: once migrations were measured, the limit is at least the tokens the decode worker
    # prefills in one mean migration time (migration_ms / prefill_ms_per_token); 0: the fixed limit
    prefill_ms_per_token: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"disaggregate must be one of {MODES}, got {self.mode!r}")
        if self.local_prefill_max_tokens < 0 or self.local_prefill_max_waiting < 1:
            raise ValueError("local_prefill_max_tokens must be >= 0 and local_prefill_max_waiting >= 1")
        if self.prefill_ms_per_token < 0:
            raise ValueError(f"prefill_ms_per_token must be >= 0, got {self.prefill_ms_per_token}")


@dataclass(frozen=True)
class Decision:
    path: str          # one of PATHS
    reason_kind: str   # closed set: policy_always, policy_never, decode_busy, short_uncached, long_uncached
    reason: str        # for people: the numbers that decided it

    def to_dict(self) -> dict:
        return {"path": self.path, "reason": self.reason}


def prefill_rate(x: DecideInputs, c: DecideConfig) -> float:
    """Prefill ms per token on the decode worker: configured (a profile file), else measured at the
    decode worker's startup, else 0 (unknown)."""
    if c.prefill_ms_per_token > 0:
        return c.prefill_ms_per_token
    p = x.decode_prefill_ms_per_token
    return p if p is not None and p > 0 else 0.0


def limit_tokens(x: DecideInputs, c: DecideConfig) -> int:
    """The longest uncached prompt `auto` prefills locally for these inputs."""
    base, p = c.local_prefill_max_tokens, prefill_rate(x, c)
    if x.migration_ms is not None and p > 0:  # measured on this transport, now
        base = max(base, int(x.migration_ms / p))
    return base * min(1 + max(0, x.prefill_queue_depth), MAX_QUEUE_FACTOR) // max(1, x.decode_running)


def from_profile(profile: dict) -> dict:
    """DecideConfig fields from a `pdserve profile --json` document: its crossover as the base limit
    and its prefill ms per token ({} for what it lacks). ValueError names a malformed one."""
    fits = profile.get("fits") if isinstance(profile, dict) else None
    if not isinstance(fits, dict):
        raise ValueError("not a `pdserve profile --json` document: it has no 'fits'")
    out = {}
    limit, p = fits.get("local_prefill_max_tokens"), fits.get("prefill_ms_per_token")
    if isinstance(limit, (int, float)) and not isinstance(limit, bool) and limit >= 0:
        out["local_prefill_max_tokens"] = int(limit)
    if isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0:
        out["prefill_ms_per_token"] = float(p)
    return out


def decide(x: DecideInputs, c: DecideConfig) -> Decision:
    """Where this request's prompt is prefilled (see the module doc for the model)."""
    if c.mode == "always":
        return Decision("disaggregate", "policy_always", "disaggregate=always")
    if c.mode == "never":
        return Decision("local_prefill", "policy_never", "disaggregate=never")
    uncached = max(0, x.prompt_tokens - x.decode_cached_tokens)
    if x.decode_queue_depth >= c.local_prefill_max_waiting:
        return Decision("disaggregate", "decode_busy",
                        f"decode worker has {x.decode_queue_depth} waiting >= {c.local_prefill_max_waiting}")
    limit = limit_tokens(x, c)
    queued = f" ({x.prefill_queue_depth} queued at prefill)" if x.prefill_queue_depth > 0 else ""
    cached = f", {x.decode_cached_tokens} cached on decode" if x.decode_cached_tokens else ""
    batch = f", {x.decode_running} running on decode" if x.decode_running > 1 else ""
    facts = f"{queued}{cached}{batch}"
    if uncached <= limit:
        return Decision("local_prefill", "short_uncached", f"uncached {uncached} tokens <= {limit}{facts}")
    return Decision("disaggregate", "long_uncached", f"uncached {uncached} tokens > {limit}{facts}")
