"""`pdserve bench chaos`: faults injected into a running cluster under steady concurrent load, every
answer checked against the local engine.

One cluster (1 prefill + 2 decode workers on an embedded local Ray by default) serves the whole
run; the faults (bench.chaos_faults) run one after another, one phase each. A phase sends its
requests (random byte-level prompts; greedy and seeded sampling, some with n=2; streamed and not)
through `concurrency` client threads, injects its fault once a quarter of them have started, then
measures the time to recover capacity: from the injection until the cluster again has its full
worker count alive (a killed worker's replacement joined), the armed transfer faults were all
applied (or the load ran out), and a probe request is answered correctly. Once its load is done,
it waits (bounded) for the cluster to be at rest and counts leaked blocks: used or reserved
blocks still in any live worker's pool, pool counts that no longer add up to the pool's size,
and blocks the ledger still records as owned. Corruptions injected are the prefill workers'
`corruptions_injected` over the phase; detected are the decode workers' `checksum_errors`; false
positives are detections beyond the injections. The reference tokens of every request come from
one in-process `LLMEngine` with the same model: greedy and seeded sampling are reproducible there
(counter-based noise), so every token the cluster streams can be checked. Progress goes to stderr.
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np

from bench.chaos_client import ChaosRequest, classify, send
from bench.chaos_faults import BY_NAME, CORRUPTIONS, FAULTS, Target, cluster_info, live
from bench.chaos_hostile import hostile_summary
from bench.chaos_report import totals


@dataclass(frozen=True)
class ChaosConfig:
    """faults: names from bench.chaos_faults.FAULTS, one phase each, in order. requests_per_fault:
    load requests per phase (probes come on top). concurrency: client threads. fault_count: faults
    armed per transfer-fault phase (on each prefill worker). prefill / decode / num_blocks /
    transport: the cluster. heartbeat_timeout_s: how soon a killed worker is declared dead.
    step_budget: every engine's token budget per step (prompts longer than it, or sharing a step,
    prefill in chunks, so their KV migrates streamed and the transfer faults hit streams too).
    seed: base seed of prompts and sampling seeds. request_timeout_s: the client's bound on one
    request. rest_timeout_s: bound on waiting for the cluster to be at rest after a phase.
    recover_timeout_s: bound on waiting for capacity after an injection."""

    faults: tuple[str, ...] = tuple(f.name for f in FAULTS)
    requests_per_fault: int = 64
    concurrency: int = 6
    fault_count: int = 6
    prefill: int = 1
    decode: int = 2
    num_blocks: int = 512
    transport: str = "zmq"
    heartbeat_timeout_s: float = 4.0
    seed: int = 0
    request_timeout_s: float = 120.0
    rest_timeout_s: float = 60.0
    recover_timeout_s: float = 120.0
    start_timeout_s: float = 240.0
    step_budget: int = 128  # engine tokens per step: longer prompts prefill in chunks and stream

    def __post_init__(self) -> None:
        unknown = [f for f in self.faults if f not in BY_NAME]
        if unknown:
            raise ValueError(f"unknown faults {unknown}; known: {', '.join(BY_NAME)}")
        if self.requests_per_fault < 4 or self.concurrency < 1 or self.fault_count < 1:
            raise ValueError("requests_per_fault must be >= 4, concurrency and fault_count >= 1")
        if self.decode < 2:
            raise ValueError("chaos needs >= 2 decode workers (a killed one's requests move to another)")


QUICK = ChaosConfig(requests_per_fault=20, fault_count=3)  # 17 faults x 20 = 340 requests, plus probes
PROBES = 16  # probe requests prepared per phase (reused cyclically)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- workload and reference ---------------------------------------------------------------------
def make_phase(fault, cfg: ChaosConfig, phase: int) -> tuple[list[ChaosRequest], list[ChaosRequest]]:
    """The phase's load (a fresh seed per phase: no prefix-cache hits across phases) and its probes."""
    rng = np.random.default_rng(cfg.seed * 1_000 + phase)

    def prompt(lo: int, hi: int) -> list[int]:
        return [int(x) for x in rng.integers(32, 127, size=int(rng.integers(lo, hi + 1)))]

    load = []
    for i in range(cfg.requests_per_fault):
        kind = i % 4  # 0 greedy, 1 greedy streamed, 2 seeded, 3 seeded streamed
        params = {"max_tokens": int(rng.integers(fault.max_tokens[0], fault.max_tokens[1] + 1)),
                  "temperature": 0, "ignore_eos": True}
        if kind >= 2:
            params.update(temperature=0.8, top_k=40, top_p=0.95, seed=int(rng.integers(1, 2**31)))
            if i % 8 == 2:
                params["n"] = 2
        stream = kind in (1, 3)
        away = 2 if fault.disconnect and stream and (i // 2) % 2 == 0 else 0
        load.append(ChaosRequest(i, prompt(*fault.prompt_len), params, stream, away))
    greedy8 = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    probes = [ChaosRequest(10_000 + j, prompt(16, 48), greedy8) for j in range(PROBES)]
    return load, probes


def reference(engine, reqs: list[ChaosRequest]) -> list[list[list[int]]]:
    """The local engine's token ids per request, per choice (one batched run)."""
    from engine.sampling import SamplingParams

    done = engine.generate([r.prompt for r in reqs], [SamplingParams(**r.params) for r in reqs])
    return [[c["token_ids"] for c in comp.choices] for comp in done]


# ---- the cluster's state ------------------------------------------------------------------------
COUNTERS = ("faults_injected", "corruptions_injected", "checksum_errors", "transfer_errors",
            "streamed_migrations", "stream_fallbacks")


def counters(info: dict) -> dict:
    return {w["name"]: {k: int(w.get(k) or 0) for k in COUNTERS} for w in info["workers"]}


def growth(after: dict, before: dict, key: str) -> int:
    """How much `key` grew over the phase, summed over workers (one not there before starts at 0)."""
    return sum(max(0, c[key] - before.get(name, {}).get(key, 0)) for name, c in after.items())


def full_strength(info: dict, cfg: ChaosConfig, gone: str = "") -> bool:
    p, d = live(info, "prefill"), live(info, "decode")
    return len(p) == cfg.prefill and len(d) == cfg.decode and gone not in {w["name"] for w in p + d}


def wait_at_rest(port: int, cfg: ChaosConfig) -> tuple[dict, int]:
    """/v1/cluster once nothing is in flight anywhere (bounded), and the blocks leaked then."""
    end = time.monotonic() + cfg.rest_timeout_s
    while True:
        info = cluster_info(port)
        workers = [w for w in info["workers"] if w["alive"]]
        quiet = info["ledger"]["active_requests"] == 0 and full_strength(info, cfg) and all(
            w["used_blocks"] == 0 and w.get("reserved_blocks", 0) == 0 and w.get("held_for_resend", 0) == 0
            and w.get("leases", 0) == 0 for w in workers)
        if quiet or time.monotonic() > end:
            break
        time.sleep(0.25)
    time.sleep(3 * 0.2)  # a few more reports: the error counters include everything the phase did
    info = cluster_info(port)
    workers = [w for w in info["workers"] if w["alive"]]
    pools = sum(w["used_blocks"] + w.get("reserved_blocks", 0) for w in workers)
    pools += sum(abs(w["total_blocks"] - w["free_blocks"] - w["cached_blocks"] - w["used_blocks"])
                 for w in workers)
    return info, max(pools, int(info["ledger"]["owned_blocks"]))


# ---- one phase ------------------------------------------------------------------------------------
def _recover(t: Target, cfg: ChaosConfig, fault, detail: dict, before: dict, t0: float, futures,
             probes, probe_refs, tally: Counter) -> float | None:
    """Seconds from the injection at t0 until capacity is back (see the module docstring)."""
    gone, armed = detail.get("victim", "") if fault.kills else "", detail.get("armed", 0)
    i = 0
    while time.monotonic() - t0 < cfg.recover_timeout_s:
        info = cluster_info(t.port)
        applied = not fault.transfer or growth(counters(info), before, "faults_injected") >= armed \
            or all(f.done() for f in futures)
        if full_strength(info, cfg, gone) and applied:
            probe = probes[i % len(probes)]
            verdict = classify(send(t.port, probe, cfg.request_timeout_s), probe_refs[i % len(probes)])
            tally[verdict] += 1
            i += 1
            if verdict == "correct":
                return time.monotonic() - t0
        time.sleep(0.2)
    return None


def run_phase(t: Target, cfg: ChaosConfig, fault, load, refs, probes, probe_refs) -> dict:
    before = counters(cluster_info(t.port))
    tally: Counter = Counter()
    lock, started = threading.Lock(), [0]

    def one(req: ChaosRequest):
        with lock:
            started[0] += 1
        return send(t.port, req, cfg.request_timeout_s)

    with concurrent.futures.ThreadPoolExecutor(cfg.concurrency) as pool:
        futures = [pool.submit(one, r) for r in load]
        while started[0] < max(2, len(load) // 4):
            time.sleep(0.01)
        t0 = time.monotonic()
        detail = fault.inject(t)
        t0 = detail.pop("fault_at", t0)  # a kill waits for its moment: recovery counts from the kill
        _log(f"  injected {fault.name}: {detail}")
        recovery = _recover(t, cfg, fault, detail, before, t0, futures, probes, probe_refs, tally)
        outcomes = [f.result() for f in futures]
    errors: Counter = Counter()
    for out, ref in zip(outcomes, refs):
        verdict = classify(out, ref)
        tally[verdict] += 1
        if verdict != "correct":
            errors[f"{verdict}: {out.status or ''} {out.error[:80]}".strip()] += 1
    info, leaked = wait_at_rest(t.port, cfg)
    after = counters(info)
    injected = growth(after, before, "corruptions_injected")
    detected = growth(after, before, "checksum_errors")
    breaches = int(detail.get("breaches", 0))
    detail.update(faults_injected=growth(after, before, "faults_injected"),
                  transfer_errors=growth(after, before, "transfer_errors"),
                  streamed_migrations=growth(after, before, "streamed_migrations"),
                  stream_fallbacks=growth(after, before, "stream_fallbacks"),
                  probes=sum(tally.values()) - len(load), errors=dict(errors),
                  disconnected=sum(o.end == "disconnected" for o in outcomes))
    return {"fault": fault.name, "requests": sum(tally.values()), "correct": tally["correct"],
            "failed_clean": tally["failed_clean"], "wrong": tally["wrong"] + breaches,
            "leaked_blocks": leaked, "corruptions_injected": injected, "corruptions_detected": detected,
            "false_positives": max(0, detected - injected),
            "recovery_s": None if recovery is None else round(recovery, 3), "detail": detail}


# ---- the whole run ----------------------------------------------------------------------------------
def cluster_config(cfg: ChaosConfig):
    from coordinator.config import ClusterConfig

    return ClusterConfig(prefill=cfg.prefill, decode=cfg.decode, transport=cfg.transport, model="tiny",
                         engine={"scheduler": {"max_num_batched_tokens": cfg.step_budget}},
                         num_blocks=cfg.num_blocks, heartbeat_timeout_s=cfg.heartbeat_timeout_s,
                         restart_backoff_s=0.5, max_restarts=10, reserve_wait_s=10.0,
                         start_timeout_s=cfg.start_timeout_s)


def run_chaos(cfg: ChaosConfig, log=_log) -> dict:
    """Bring a cluster up, run every fault's phase, shut everything down; the JSON report."""
    import torch

    from deploy.launch import ClusterServer, RayConfig, start_ray, stop_ray
    from engine.engine import EngineConfig, LLMEngine

    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(model="tiny"))
    entries: list[dict] = []
    t_start = time.monotonic()
    started = start_ray(RayConfig(num_cpus=2))
    try:
        srv = ClusterServer(cluster_config(cfg))
        try:
            port = srv.start(timeout=cfg.start_timeout_s)
            log(f"chaos: cluster up on port {port} ({cfg.prefill} prefill + {cfg.decode} decode, "
                f"{cfg.transport}); {len(cfg.faults)} faults x {cfg.requests_per_fault} requests")
            target = Target(srv, port, engine.storage.layout.fingerprint(), cfg.fault_count, log,
                            settle_s=cfg.heartbeat_timeout_s + 1.5)
            for phase, name in enumerate(cfg.faults):
                fault = BY_NAME[name]
                load, probes = make_phase(fault, cfg, phase)
                refs = reference(engine, load + probes)
                log(f"[{phase + 1}/{len(cfg.faults)}] {name}: {len(load)} requests")
                entry = run_phase(target, cfg, fault, load, refs[:len(load)], probes, refs[len(load):])
                entries.append(entry)
                log(f"  {_summary(entry)}")
        finally:
            srv.stop()
    finally:
        stop_ray(started)
    return {"config": {**asdict(cfg), "faults": list(cfg.faults), "model": "tiny"},
            "duration_s": round(time.monotonic() - t_start, 1), "faults": entries, "totals": totals(entries),
            "hostile": hostile_summary(entries)}


def _summary(e: dict) -> str:
    rec = "-" if e["recovery_s"] is None else f"{e['recovery_s']:.2f} s"
    flips = f", corruptions {e['corruptions_injected']}/{e['corruptions_detected']}" \
        if e["fault"] in CORRUPTIONS or e["corruptions_detected"] else ""
    hostile = e["detail"].get("hostile")
    tail = "" if hostile is None else (
        f"; hostile: {hostile['failures']} failures, restarted {hostile['workers_restarted']}, "
        f"empty slots {hostile['empty_slots']}, http {hostile['http']}")
    return (f"{e['requests']} requests: {e['correct']} correct, {e['failed_clean']} failed clean, "
            f"{e['wrong']} wrong; leaked {e['leaked_blocks']}{flips}; recovery {rec}{tail}")


def passed(report: dict) -> bool:
    """The issue's done criteria: no wrong answer, no leak, every corruption detected, no false
    positive, and hostile input (when that phase ran) cost no 5xx, no worker and no slot."""
    t, hostile = report["totals"], report.get("hostile")
    return (t["wrong"] == 0 and t["leaked_blocks"] == 0 and t["false_positives"] == 0
            and t["corruptions_injected"] == t["corruptions_detected"]
            and (hostile is None or hostile["failures"] == 0))
