"""SLOs scaled to the model and the machine, DistServe's way, and how long a serving run will take.

`SLOScale`: the TTFT SLO is `ttft` times the unloaded TTFT (the workload's prompts with
max_tokens=1, one at a time: the prefill and the serving path, nothing queued), the TPOT SLO `tpot`
times the unloaded TPOT (full requests one at a time: the decode step of a batch of one). Both are
measured at the start of the run, on the first setup brought up (colocated, which migrates
nothing), so every setup is held to the same SLOs and an SLO means the same thing on any machine
and model. A multiple of None keeps that SLO fixed at the given ms instead.

`estimate_seconds`: a serving run's length from those unloaded times, before it runs (printed at
the start; docs/benchmarks-serving.md sizes `--quick` with it).
"""

from __future__ import annotations

from dataclasses import dataclass

from measure.serve_metrics import SLO

# defaults: TTFT 5x the unloaded prefill (DistServe's chatbot SLOs sit at a few times it), TPOT 2x the
# unloaded decode step (tight: the case where prefill interference decides, the target)
TTFT_MULTIPLE = 5.0
TPOT_MULTIPLE = 2.0


@dataclass(frozen=True)
class SLOScale:
    """ttft / tpot: the multiples of the unloaded TTFT and TPOT p50 (None: that SLO is fixed)."""

    ttft: float | None = TTFT_MULTIPLE
    tpot: float | None = TPOT_MULTIPLE

    def __post_init__(self) -> None:
        for name in ("ttft", "tpot"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"the {name} SLO multiple must be > 0, got {v}")

    @property
    def fixed(self) -> bool:
        return self.ttft is None and self.tpot is None


def scaled(scale: SLOScale, fixed: SLO, unloaded_ttft_ms: float | None,
           unloaded_tpot_ms: float | None) -> SLO:
    """The SLO: each multiple times its unloaded time, or `fixed`'s value where the multiple is None.
    ValueError when a multiple has no unloaded time to scale (the calibration failed)."""
    def one(mult, unloaded, given, name):
        if mult is None:
            return given
        if unloaded is None or not unloaded > 0:
            raise ValueError(f"cannot scale the {name} SLO: the unloaded {name} was not measured "
                             f"(every calibration request failed, or it sent none)")
        return mult * unloaded

    return SLO(ttft_ms=one(scale.ttft, unloaded_ttft_ms, fixed.ttft_ms, "TTFT"),
               tpot_ms=one(scale.tpot, unloaded_tpot_ms, fixed.tpot_ms, "TPOT"))


def record(scale: SLOScale, slo: SLO, unloaded_ttft_ms, unloaded_tpot_ms, measured_on: str | None) -> dict:
    """The JSON's `slo_scaling`: the multiples (None: fixed), the unloaded times and the SLOs."""
    return {"ttft_multiple": scale.ttft, "tpot_multiple": scale.tpot, "unloaded_ttft_ms": unloaded_ttft_ms,
            "unloaded_tpot_ms": unloaded_tpot_ms, "measured_on": measured_on,
            "ttft_slo_ms": slo.ttft_ms, "tpot_slo_ms": slo.tpot_ms}


# NOTE: the search's first rate as a share of `workers` requests served back to back. The measured
# goodputs on SmolLM2 (1P+1D and colocated, long prompts with long outputs, 2 cores) sat at 0.37-0.62
# of that upper bound: prefill contention and the TPOT SLO bite before the cores are full
START_SHARE = 0.5


def start_rate(workers: int, unloaded_ttft_ms: float, unloaded_tpot_ms: float, mean_output: float,
               share: float = START_SHARE) -> float:
    """A first rate for the goodput search: `share` of `workers` requests served back to back each at
    their unloaded end-to-end time (the search doubles or halves from there)."""
    e2e_s = (unloaded_ttft_ms + max(0.0, mean_output - 1) * unloaded_tpot_ms) / 1000.0
    return share * workers / max(e2e_s, 1e-3)


def estimate_seconds(setups: int, rates: list[float], requests: int, unloaded_ttft_ms: float,
                     unloaded_tpot_ms: float, mean_output: float, calibration_requests: int,
                     start_s: float = 40.0) -> float:
    """A run's length: per setup, its start (`start_s`: the model's load and warm-up), the calibration
    (`calibration_requests` prefill-only plus as many full requests, one at a time) and one run of
    `requests` per rate in `rates` (req/s), each ending one unloaded request after its last arrival."""
    e2e_s = (unloaded_ttft_ms + max(0.0, mean_output - 1) * unloaded_tpot_ms) / 1000.0
    calibration = calibration_requests * (unloaded_ttft_ms / 1000.0 + e2e_s)
    steps = sum(requests / max(rate, 1e-6) + e2e_s for rate in rates)
    return setups * (start_s + calibration + steps)


def slowest_rates(start: float, steps: int, span: float) -> list[float]:
    """The rates of the longest search: every step fails, so each halves the rate, down to start / span
    (then it stops)."""
    out, floor = [start], start / span
    while len(out) < steps and out[-1] > floor * (1 + 1e-9):
        out.append(max(floor, out[-1] / 2))
    return out
