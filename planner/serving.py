"""The serving path's cost, per configuration kind ('colocated', 'disaggregated'): what a request
pays outside the engine model (HTTP, the coordinator, ZeroMQ to the worker and back, the per-step
report, detokenizing, SSE, the client) and what the profile's in-process engine does not show of a
worker's engine. Per request it is `work_ms` = `request_ms + request_ms_per_token *
computed_tokens + request_ms_per_prompt_token * prompt_tokens` (computed_tokens: the prompt
tokens its prefill computed, cached ones excluded) plus `cold_ms * (1 - exp(-idle_ms /
cold_tau_ms))` (idle_ms: how long the cluster had been idle when it arrived, 0 if anything was
busy); `ttft_ms` is their sum. The discrete-event simulation runs `work_ms` in series with the
engine that prefills the request (its step that finishes the prompt lasts that much longer, so
the requests queued behind it wait for it, as they do in a worker on these cores) and adds only
the cold part afterwards; and it adds `token_ms` to every step a worker loop takes that decodes
(its reports, stats and KV polls: at batch 1 one iteration is one token).
`request_ms_per_prompt_token` is what the prompt's length costs whether or not its tokens are
computed (shipping and hashing the ids, attention over the cached part); `cold_ms` is the wake-up
cost of an idle cluster (a request sent >= ~0.2 s after the previous answer pays it whole; one
sent back to back pays none). planner.profile_serving measures the terms (`fits.serving.<kind>` in
the profile JSON) and `fit_ttft` fits them; a profile with only the older constants
(`fits.request_overhead_ms.<kind>`, `fits.token_overhead_ms.<kind>`) still loads.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

import numpy as np

KINDS = ("colocated", "disaggregated")
TAUS_MS = (5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)  # the cold time constants fit_ttft tries


@dataclass(frozen=True)
class ServingPath:
    request_ms: float = 0.0            # every TTFT
    request_ms_per_token: float = 0.0  # every TTFT, per prompt token computed
    request_ms_per_prompt_token: float = 0.0  # every TTFT, per prompt token, cached or not
    token_ms: float = 0.0              # every later token's interval
    cold_ms: float = 0.0               # a TTFT after the cluster idled long (see the module doc)
    cold_tau_ms: float = 0.0           # how fast an idle cluster goes cold
    cpu_ms: float = 0.0                # CPU the serving processes (coordinator, client) spend per request

    def cold(self, idle_ms: float) -> float:
        if self.cold_ms <= 0 or idle_ms <= 0:
            return 0.0
        if self.cold_tau_ms <= 0:
            return self.cold_ms
        return self.cold_ms * (1.0 - math.exp(-idle_ms / self.cold_tau_ms))

    def work_ms(self, computed_tokens: int, prompt_tokens: int) -> float:
        """The per-request part, without the cold part (see the module doc)."""
        return (self.request_ms + self.request_ms_per_token * computed_tokens
                + self.request_ms_per_prompt_token * prompt_tokens)

    def ttft_ms(self, computed_tokens: int, prompt_tokens: int, idle_ms: float) -> float:
        return self.work_ms(computed_tokens, prompt_tokens) + self.cold(idle_ms)

    def describe(self) -> str:
        return (f"+{self.request_ms:.1f} ms + {self.request_ms_per_token * 1e3:.1f} ms/1k computed + "
                f"{self.request_ms_per_prompt_token * 1e3:.1f} ms/1k prompt tokens, "
                f"cold +{self.cold_ms:.1f} ms (tau {self.cold_tau_ms:g} ms) per request, "
                f"+{self.token_ms:.2f} ms per decoding step (per token at batch 1)")

    def to_json(self) -> dict:
        return asdict(self)


def from_fits(fits: dict, kind: str) -> ServingPath:
    """The kind's path from a profile's `fits`: `serving.<kind>` when present, else the older
    per-kind constants (`request_overhead_ms`, `token_overhead_ms`), else nothing."""
    new = (fits.get("serving") or {}).get(kind)
    if new:
        return ServingPath(**{k: float(new.get(k) or 0.0) for k in ServingPath.__dataclass_fields__})
    req, tok = fits.get("request_overhead_ms") or {}, fits.get("token_overhead_ms") or {}
    return ServingPath(request_ms=float(req.get(kind) or 0.0), token_ms=float(tok.get(kind) or 0.0))


def _cells(rows: list[dict]) -> list[tuple[float, float, float, float]]:
    """(computed, prompt tokens, idle_ms, residual ms) medians per (prompt, computed, gap) cell: one
    outlier moves nothing."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["tokens"], r.get("computed", r["tokens"]), r["gap_ms"]), []).append(r)
    med = statistics.median
    return [(float(c), float(t), med(r["idle_ms"] for r in g), med(r["resid_ms"] for r in g))
            for (t, c, _), g in sorted(groups.items())]


def fit_ttft(rows: list[dict]) -> dict:
    """rows: {"tokens" (prompt), "computed" (its tokens not cached; default all), "gap_ms" (the
    idle gap planned before it; 0: back to back), "idle_ms" (the one measured), "resid_ms" (TTFT
    minus the engine model)}. Least squares of resid = a + b * computed + p * tokens + cold * (1 -
    exp(-idle / tau)) on the cell medians, tau the best of TAUS_MS; b, p and cold are clamped to >= 0
    (a negative one is dropped and the rest refitted). Returns the terms and the cells' rms error."""
    cells = _cells(rows)
    if not cells:
        return {"request_ms": 0.0, "request_ms_per_token": 0.0, "request_ms_per_prompt_token": 0.0,
                "cold_ms": 0.0, "cold_tau_ms": 0.0, "rms_ms": None}
    c, t, idle, y = (np.array(v) for v in zip(*cells))
    best = None
    for tau in TAUS_MS:
        x = np.where(idle > 0, 1.0 - np.exp(-np.maximum(idle, 0.0) / tau), 0.0)
        a = np.column_stack([np.ones_like(t), c, t, x])
        coef = _nonneg_lstsq(a, y)
        err = float(np.sqrt(np.mean((a @ coef - y) ** 2)))
        if best is None or err < best[0] - 1e-9:
            best = (err, tau, coef)
    err, tau, (a0, b, p, cold) = best
    return {"request_ms": float(a0), "request_ms_per_token": float(b),
            "request_ms_per_prompt_token": float(p), "cold_ms": float(cold),
            "cold_tau_ms": tau if cold > 0 else 0.0, "rms_ms": err}


def _nonneg_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every column but the first (the intercept) kept >= 0: a column whose
    coefficient comes out negative is dropped and the rest refitted, until none does."""
    keep = list(range(a.shape[1]))
    while True:
        if np.linalg.matrix_rank(a[:, keep]) < len(keep):
            keep = [k for k in keep if k == 0 or np.any(a[:, k] != a[0, k])]  # constant columns: gone
        sol = np.linalg.lstsq(a[:, keep], y, rcond=None)[0]
        neg = [k for k, c in zip(keep, sol) if k != 0 and c < 0]
        if not neg:
            out = np.zeros(a.shape[1])
            out[keep] = sol
            return out
        keep.remove(neg[0])
