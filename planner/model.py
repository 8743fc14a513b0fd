"""Step and migration times from a `pdserve profile` JSON. An engine step that decodes B sequences
holding C context tokens in all and computes K prompt tokens costs `max(d0 [B>0], p0 [K>0]) +
d_seq*B + d_ctx*C + p*K` ms: the profile's prefill fit (p0 + p*K, one prompt alone) and decode fit
(d0 + d_seq*B + d_ctx*C, refitted here from the raw rows by least squares on both variables where
the profile varied both, else on B alone) share one fixed cost, since one forward pass carries both
(Sarathi-style mixed steps). A migration of T tokens costs `m0 + m_byte * T * kv_bytes_per_token`.
Negative fitted slopes (noise) are clamped to 0. When other engines of the same machine step at the
same time, each step is stretched by `1 + contention * (other busy engines)` (0: engines never slow
each other; 1: two engines on cores enough for one); a profile that measured it supplies the default
(`fits.contention`: two colocated workers streaming at once against one;
profiles before 2026-12-03 afternoon: two bare engines stepping at once, which leaves out the
coordinator and the client relaying the tokens on the same cores: 0.00-0.04 here where serving
measured 0.46-0.78). The serving path (HTTP, coordinator, ZeroMQ, per-step reports, detokenizing,
SSE, the client) adds what the profile's serving part measured per configuration kind ('colocated',
'disaggregated'): a planner.serving.ServingPath each (`serving(kind)`; all 0 for a profile taken
with --no-serving; planner.des runs its per-request work in series with the engine), its cold
part stretched by `serving_stretch` when engines are busy (the free cores the contention implies,
`cores` from the profile's machine).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from planner.serving import ServingPath, from_fits


@dataclass(frozen=True)
class StepModel:
    prefill_fixed_ms: float
    prefill_ms_per_token: float
    decode_fixed_ms: float
    decode_ms_per_seq: float
    decode_ms_per_ctx: float
    migration_fixed_ms: float
    migration_ms_per_byte: float
    kv_bytes_per_token: float
    block_size: int = 16
    contention: float = 0.0     # step stretch per other engine busy at the same time (see module doc)
    crossover_tokens: int | None = None  # the profile's suggested local_prefill_max_tokens
    colocated: ServingPath = ServingPath()      # the serving path per configuration kind
    disaggregated: ServingPath = ServingPath()
    cores: int = 0              # the machine's (profile's machine.cores); 0: unknown, no serving stretch

    def free_cores(self) -> float:
        """Cores left to this cluster, as the contention measurement implies: two engines stepping
        at once run 1 + contention times slower than one, so 2 / (1 + contention) cores were free
        (all of them when contention is 0)."""
        if self.contention <= 0:
            return float(self.cores)
        return min(float(self.cores), 2.0 / (1.0 + self.contention))

    def serving_stretch(self, busy_engines: int) -> float:
        """How much slower the serving path's cold part runs with `busy_engines` engines stepping
        than with none (what the profile measured): its process shares the free cores with them."""
        if self.cores <= 0:
            return 1.0
        free = self.free_cores()
        return max(1.0, (busy_engines + 1) / free) / max(1.0, 1.0 / free)

    def serving(self, kind: str) -> ServingPath:
        return self.colocated if kind == "colocated" else self.disaggregated

    def request_overhead_ms(self, kind: str) -> float:
        """The serving path's fixed part of every TTFT (its per-token and cold parts: `serving`)."""
        return self.serving(kind).request_ms

    def token_overhead_ms(self, kind: str) -> float:
        return self.serving(kind).token_ms

    # the fixed parts under their older names (pdserve_cli.cmd_plan prints them)
    overhead_colocated_ms = property(lambda self: self.colocated.request_ms)
    overhead_disaggregated_ms = property(lambda self: self.disaggregated.request_ms)
    token_overhead_colocated_ms = property(lambda self: self.colocated.token_ms)
    token_overhead_disaggregated_ms = property(lambda self: self.disaggregated.token_ms)

    def step_ms(self, batch: int, context: int, prefill_tokens: int, others_busy: int = 0,
                loop_ms: float = 0.0, load: float = 0.0) -> float:
        """One engine step, plus `loop_ms` of its worker loop's own work (see planner.des);
        `load`: cores' worth of CPU the serving processes use meanwhile (see `stretch`)."""
        fixed = max(self.decode_fixed_ms if batch else 0.0, self.prefill_fixed_ms if prefill_tokens else 0.0)
        ms = fixed + self.decode_ms_per_seq * batch + self.decode_ms_per_ctx * context \
            + self.prefill_ms_per_token * prefill_tokens + loop_ms
        return ms * self.stretch(others_busy, load)

    def stretch(self, others_busy: int, load: float = 0.0) -> float:
        """How much longer a step runs with `others_busy` other engines stepping and `load` cores of
        serving work (coordinator, client) beside it: the measured engine-against-engine contention,
        or, where more is running than the machine has cores, their share of the cores (every
        process on them alike), whichever is more."""
        stretch = 1.0 + self.contention * others_busy
        if self.cores > 0 and load > 0:
            stretch = max(stretch, (others_busy + 1 + load) / self.cores)
        return stretch

    def prefill_ms(self, tokens: int) -> float:
        """One prompt's prefill alone in one step (what the profile measured)."""
        return self.step_ms(0, 0, tokens)

    def migration_ms(self, tokens: int) -> float:
        return self.migration_fixed_ms + self.migration_ms_per_byte * tokens * self.kv_bytes_per_token


def _decode_fit(rows: list[dict], fits: dict) -> tuple[float, float, float]:
    """(d0, per sequence, per context token): both variables where the profile varied both."""
    if len(rows) >= 3:
        a = np.array([[1.0, r["batch"], r["total_context"]] for r in rows])
        y = np.array([r["step_ms"] for r in rows])
        if np.linalg.matrix_rank(a) == 3:
            d0, ds, dc = np.linalg.lstsq(a, y, rcond=None)[0]
            return float(d0), float(ds), float(dc)
    return fits["decode_step_fixed_ms"], fits["decode_ms_per_sequence"], 0.0


def from_profile(profile: dict, contention: float | None = None) -> StepModel:
    """The model of a `pdserve profile` report (its `fits`, and its raw `decode` rows); contention
    None: the profile's measured factor, 0 where it has none."""
    f = profile["fits"]
    if contention is None:
        contention = float(f.get("contention") or 0.0)
    d0, ds, dc = _decode_fit(profile.get("decode", []), f)
    cores = (profile.get("machine") or {}).get("cores") or {}
    paths = {kind: from_fits(f, kind) for kind in ("colocated", "disaggregated")}
    for kind, path in paths.items():  # profiles without the loaded phase: the sequential coordinator
        # CPU per request, an overstatement (no batching) that leaves out the client's
        cpu = ((profile.get("serving") or {}).get(kind) or {}).get("process_cpu_ms_per_request")
        if not path.cpu_ms and cpu:
            paths[kind] = replace(path, cpu_ms=float(cpu))
    pos = lambda x: max(0.0, float(x))  # noqa: E731  (noise can fit a negative slope)
    return StepModel(pos(f["prefill_fixed_ms"]), pos(f["prefill_ms_per_token"]), pos(d0), pos(ds), pos(dc),
                     pos(f["migration_fixed_ms"]), pos(f["migration_ms_per_byte"]),
                     float(f.get("kv_bytes_per_token") or 0.0),
                     int(profile.get("config", {}).get("block_size", 16)), contention,
                     f.get("local_prefill_max_tokens"), paths["colocated"], paths["disaggregated"],
                     int(cores.get("affinity") or cores.get("logical") or 0))


def synthetic(prefill_fixed_ms=1.0, prefill_ms_per_token=0.01, decode_fixed_ms=1.0,
              decode_ms_per_seq=0.1, migration_fixed_ms=1.0, migration_ms_per_token=0.001,
              block_size=16, contention=0.0, request_overhead_ms=0.0, token_overhead_ms=0.0,
              serving: ServingPath | None = None) -> StepModel:
    """A hand-written model (tests, what-ifs): migration given per token (1 byte per token); the
    serving path the same for both kinds (`serving`, else the two constants)."""
    path = serving or ServingPath(request_ms=request_overhead_ms, token_ms=token_overhead_ms)
    return StepModel(prefill_fixed_ms, prefill_ms_per_token, decode_fixed_ms, decode_ms_per_seq, 0.0,
                     migration_fixed_ms, migration_ms_per_token, 1.0, block_size, contention, None,
                     path, path)
