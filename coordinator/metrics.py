"""Prometheus metrics of the coordinator, in its own `CollectorRegistry` (never the global one).

`Metrics` holds what the HTTP layer observes per request (TTFT, TPOT, end-to-end latency,
requests by status, errors by kind, queue depth, tokens) plus hooks the cluster backend calls
as things happen (`observe_migration`, `count_backpressure`, `count_retry`, `count_restart`,
`count_discrepancy`). Point-in-time
worker state (pool blocks, tail-slot waste, queue depth, cumulative preemptions) is rendered
at scrape time from the backend's worker dicts by `worker_metrics_text`, so counts kept by
workers never have to be mirrored here. Every metric name starts with `pdserve_`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_BYTES_BUCKETS = tuple(float(4 ** k) * 1024 for k in range(1, 13))  # 4 KiB .. 16 GiB


MIGRATION_MEAN_WEIGHT = 0.1  # weight of the newest migration in the moving mean decide reads
MIGRATION_PHASES = ("query", "export", "wire", "prepare", "land", "verify", "commit")


class Metrics:
    """Request-level metrics plus cluster hooks; `render()` is the /metrics body (bytes)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("pdserve_time_to_first_token_seconds",
                              "Time from request arrival to its first token", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.tpot = Histogram("pdserve_time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per request",
                              buckets=_TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_request_latency_seconds", "Time from request arrival to its last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("pdserve_requests", "Completion requests by outcome "
                                "(ok, client_error, server_error, aborted)", ["status"], registry=r)
        self.errors = Counter("pdserve_errors", "Errors by kind", ["kind"], registry=r)
        self.queue_depth = Gauge("pdserve_queue_depth",
                                 "Accepted requests still waiting for their first token", registry=r)
        self.in_flight = Gauge("pdserve_requests_in_flight", "Accepted requests not yet finished", registry=r)
        self.generated = Counter("pdserve_generation_tokens", "Output tokens returned to clients", registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of accepted requests",
                                     registry=r)
        # ---- cluster hooks ----
        self.migration_latency = Histogram("pdserve_migration_latency_seconds",
                                           "KV migration time, prefill export to decode commit",
                                           ["transport"], buckets=_LATENCY_BUCKETS, registry=r)
        self.migration_phase = Histogram("pdserve_migration_phase_seconds",
                                         "KV migration time per phase: query, export, wire (prefill side); "
                                         "prepare, land, verify, commit (decode side)",
                                         ["transport", "phase"], buckets=_LATENCY_BUCKETS, registry=r)
        self.migration_bytes = Histogram("pdserve_migration_bytes", "KV payload bytes per migration",
                                         ["transport"], buckets=_BYTES_BUCKETS, registry=r)
        self.migration_blocks = Counter("pdserve_migration_blocks", "KV blocks migrated", ["transport"],
                                        registry=r)
        self.discrepancies = Counter("pdserve_ledger_discrepancies", "Differences between the ledger and "
                                     "a worker's report that outlived the grace period, by kind (orphan: "
                                     "aborted there; vanished: request failed; unowned: leaked in the "
                                     "worker)", ["kind"], registry=r)
        self.backpressure = Counter("pdserve_backpressure_refusals", "Reservations a decode worker refused "
                                    "for lack of room (the request tried another or waited)", ["worker"],
                                    registry=r)
        self.retries = Counter("pdserve_retries", "Requests resumed after a worker failure, by phase",
                               ["phase"], registry=r)
        self.restarts = Counter("pdserve_worker_restarts", "Dead workers replaced, by role", ["role"],
                                registry=r)
        self.paths = Counter("pdserve_requests_by_path", "Requests by where their prompt was prefilled "
                             "(disaggregate, local_prefill) and why (coordinator.decide)", ["path", "reason"],
                             registry=r)
        self._migration_ms: dict[str, float] = {}  # transport -> moving mean of migration ms (decide)

    # ---- request lifecycle (the HTTP layer) ---------------------------------------------
    def request_admitted(self, prompt_tokens: int) -> None:
        self.in_flight.inc()
        self.queue_depth.inc()
        self.prompt_tokens.inc(prompt_tokens)

    def first_token(self, ttft_s: float) -> None:
        self.queue_depth.dec()
        self.ttft.observe(ttft_s)

    def request_done(self, status: str, *, started: bool, e2e_s: float | None = None,
                     tpot_s: float | None = None, completion_tokens: int = 0) -> None:
        """Once per admitted request; `started`: first_token() was called for it."""
        self.in_flight.dec()
        if not started:
            self.queue_depth.dec()
        self.requests.labels(status=status).inc()
        self.generated.inc(completion_tokens)
        if e2e_s is not None:
            self.e2e.observe(e2e_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)

    def request_refused(self, status: str) -> None:
        """A request turned away before admission (bad input, unknown model, no worker)."""
        self.requests.labels(status=status).inc()

    def count_error(self, kind: str) -> None:
        self.errors.labels(kind=kind).inc()

    # ---- cluster hooks --------------------------------------------------------------------
    def observe_migration(self, ms: float, nbytes: int, blocks: int = 0, transport: str = "zmq",
                          phases: dict | None = None) -> None:
        self.migration_latency.labels(transport=transport).observe(ms / 1000.0)
        for name, phase_ms in (phases or {}).items():
            if name.endswith("_ms") and name[:-3] in MIGRATION_PHASES:
                self.migration_phase.labels(transport=transport, phase=name[:-3]).observe(phase_ms / 1000.0)
        self.migration_bytes.labels(transport=transport).observe(nbytes)
        self.migration_blocks.labels(transport=transport).inc(blocks)
        mean = self._migration_ms.get(transport)
        self._migration_ms[transport] = ms if mean is None else mean + MIGRATION_MEAN_WEIGHT * (ms - mean)

    def migration_ms(self, transport: str) -> float | None:
        """Moving mean of this transport's migration times (ms), None before the first one."""
        return self._migration_ms.get(transport)

    def count_path(self, path: str, reason: str) -> None:
        self.paths.labels(path=path, reason=reason).inc()

    def count_backpressure(self, worker: str) -> None:
        self.backpressure.labels(worker=worker).inc()

    def count_discrepancy(self, kind: str) -> None:
        self.discrepancies.labels(kind=kind).inc()

    def count_restart(self, role: str) -> None:
        self.restarts.labels(role=role).inc()

    def count_retry(self, phase: str) -> None:
        self.retries.labels(phase=phase).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Snapshot:
    """A one-shot collector over prebuilt metric families."""

    def __init__(self, families):
        self._families = families

    def collect(self):
        return iter(self._families)


def worker_metrics_text(workers: list[dict]) -> str:
    """Per-worker gauges from dicts with keys name, role and any of total_blocks, used_blocks,
    free_blocks, cached_blocks, tail_waste_slots, queue_depth, running, step_budget, and the
    cumulative preemptions, alloc_calls, alloc_seconds and kv_refused_<reason>."""
    blocks = GaugeMetricFamily("pdserve_pool_blocks", "KV pool blocks per worker by state",
                               labels=["worker", "role", "state"])
    waste = GaugeMetricFamily("pdserve_pool_tail_waste_slots", "Allocated but unfilled token slots in "
                              "the last block of resident sequences", labels=["worker", "role"])
    queue = GaugeMetricFamily("pdserve_worker_queue_depth", "Requests waiting on a worker",
                              labels=["worker", "role"])
    running = GaugeMetricFamily("pdserve_worker_running", "Requests running on a worker",
                                labels=["worker", "role"])
    preempt = CounterMetricFamily("pdserve_preemptions", "Preemptions per worker", labels=["worker", "role"])
    allocs = CounterMetricFamily("pdserve_block_allocations", "Block-table allocate/append calls per worker",
                                 labels=["worker", "role"])
    alloc_s = CounterMetricFamily("pdserve_block_allocation_seconds", "Time spent in those calls (divide "
                                  "by pdserve_block_allocations for the mean allocation latency)",
                                  labels=["worker", "role"])
    refused = CounterMetricFamily("pdserve_kv_refusals", "Unauthenticated or malformed KV-link input a "
                                  "worker refused, by reason", labels=["worker", "role", "reason"])
    step = GaugeMetricFamily("pdserve_worker_step_budget_tokens", "Token budget of a worker's next engine "
                             "step (paced by time: engine.step_pacer)", labels=["worker", "role"])
    for w in workers:
        key = [str(w.get("name", "?")), str(w.get("role", "?"))]
        for field, value in w.items():
            if field.startswith("kv_refused_") and isinstance(value, (int, float)):
                refused.add_metric(key + [field[len("kv_refused_"):]], float(value))
        if isinstance(w.get("step_budget"), (int, float)):
            step.add_metric(key, float(w["step_budget"]))
        for state in ("total", "used", "free", "cached"):
            if f"{state}_blocks" in w:
                blocks.add_metric(key + [state], float(w[f"{state}_blocks"]))
        for fam, field in ((waste, "tail_waste_slots"), (queue, "queue_depth"), (running, "running"),
                           (preempt, "preemptions"), (allocs, "alloc_calls"), (alloc_s, "alloc_seconds")):
            if field in w:
                fam.add_metric(key, float(w[field]))
    reg = CollectorRegistry()
    reg.register(_Snapshot([blocks, waste, queue, running, preempt, allocs, alloc_s, refused, step]))
    return generate_latest(reg).decode()
