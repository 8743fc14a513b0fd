"""`pdserve plan` and `pdserve profile`: a discrete-event performance model of pdserve serving, built
from a `pdserve profile` JSON, that predicts TTFT/TPOT percentiles and goodput for a workload under SLOs
and searches configurations (colocated K; P prefill + D decode, with and without per-request decisions)
within a worker budget. One job per module: `model` (step and migration times from the profile),
`serving` (the serving path's cost per configuration kind, and its fit), `workload` (trace or
distributions -> requests), `sim_engine` (one simulated engine: queues, chunked steps, memory through
the real kvcache BlockAllocator), `des` (the event loop, routing, coordinator.decide, migrations),
`metrics`, `search` (configurations, rates, verdict), `report` (text, JSON, plot), `validate` (predicted
beside served, measured by measure.serve) and `profile` (with `profile_serving` and
`profile_contention`: the machine's measured costs the model reads).
"""
