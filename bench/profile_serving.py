"""`pdserve profile`'s serving part: what the engine alone does not show. The serving path (HTTP,
coordinator, ZeroMQ to the worker and back, a report every step, detokenizing, one SSE event per
token) costs time per request and per token, and the workers, the coordinator and the client share
this machine's cores. Measured here:
- serving: the real thing (`deploy.launch.ClusterServer`, bench serve's cluster settings: the
  tiny model, colocated 2 and 1P+1D with streamed migration), sequential requests one at a time
  (fresh prompts, max_tokens=1 and max_tokens=N, ignore_eos). Per request, TTFT minus the engine
  model's prefill (minus its migration when disaggregated, for the N-token requests that migrate)
  is the per-request overhead; TPOT minus the modelled batch-1 decode step is the per-token
  overhead. The medians per configuration kind are recorded (`request_overhead_ms`,
  `token_overhead_ms`), beside the raw rows;
- contention: two engines stepping at once (two processes, the same decode batch) against one
  alone: `contention = together / alone - 1`, the step stretch per other busy engine that
  bench.plan.model applies.
Bounded: every request has a timeout, every cluster and the Ray instance are always shut down.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

KINDS = {"colocated": "colocated", "disaggregated": "disaggregated"}  # kind -> bench serve mode


def _specs(lens, max_tokens: int, repeats: int, seed: int, start: int):
    from bench.loadgen import PROMPT_ID_RANGE, RequestSpec

    rng, (lo, hi), out = np.random.default_rng(seed), PROMPT_ID_RANGE, []
    for n in lens:
        for _ in range(repeats):
            prompt = [int(x) for x in rng.integers(lo, hi, size=n)]
            out.append(RequestSpec(start + len(out), 0.0, prompt, max_tokens))
    return out


def _rows(records, model, kind: str) -> list[dict]:
    rows = []
    for r in records:
        if not r.ok or r.first_s is None:
            continue
        ttft = (r.first_s - r.send_s) * 1e3
        migrates = kind == "disaggregated" and r.max_tokens > 1  # max_tokens=1 never migrates
        pred = model.prefill_ms(r.prompt_tokens) + (model.migration_ms(r.prompt_tokens) if migrates else 0.0)
        row = {"prompt_tokens": r.prompt_tokens, "max_tokens": r.max_tokens, "ttft_ms": ttft,
               "request_overhead_ms": ttft - pred}
        if r.output_tokens > 1 and r.end_s is not None:
            tpot = (r.end_s - r.first_s) * 1e3 / (r.output_tokens - 1)
            step = model.step_ms(1, r.prompt_tokens + r.output_tokens // 2, 0)
            row.update(tpot_ms=tpot, token_overhead_ms=tpot - step)
        rows.append(row)
    return rows


def _median(rows: list[dict], key: str, **match) -> float | None:
    xs = [r[key] for r in rows if key in r and all(r[k] == v for k, v in match.items())]
    return float(statistics.median(xs)) if xs else None


def measure_serving(cfg, model, log=print) -> dict:
    """Per kind: rows and the median overheads (see the module doc). `model`: the engine-only
    bench.plan StepModel of this profile."""
    from bench.serve import ServeBenchConfig, cluster_config
    from bench.serve_client import load_in_subprocess
    from deploy.launch import ClusterServer, RayConfig, start_ray, stop_ray

    scfg = ServeBenchConfig(prefill=1, decode=1, block_size=cfg.block_size, num_blocks=1024, quick=True)
    out: dict = {"prompt_lens": list(cfg.serving_prompt_lens), "max_tokens": cfg.serving_max_tokens,
                 "repeats": cfg.serving_repeats}
    started = start_ray(RayConfig(num_cpus=2))
    try:
        for kind, mode in KINDS.items():
            srv = ClusterServer(cluster_config(mode, scfg, streamed=True))
            try:
                url = f"http://127.0.0.1:{srv.start(timeout=scfg.start_timeout_s)}"
                warm = _specs((32, 32), 4, 1, 7, 0)
                one = _specs(cfg.serving_prompt_lens, 1, cfg.serving_repeats, 11, 100)
                full = _specs(cfg.serving_prompt_lens, cfg.serving_max_tokens, cfg.serving_repeats, 13, 200)
                records = []
                for specs in (warm, one, full):
                    records.append(load_in_subprocess(url, specs, 60.0, sequential=True)[0])
            finally:
                srv.stop()
            rows = _rows(records[1] + records[2], model, kind)
            out[kind] = {"rows": rows, "failed": len(records[1]) + len(records[2]) - len(rows),
                         "request_overhead_ms": _median(rows, "request_overhead_ms",
                                                        max_tokens=cfg.serving_max_tokens),
                         "prefill_only_overhead_ms": _median(rows, "request_overhead_ms", max_tokens=1),
                         "token_overhead_ms": _median(rows, "token_overhead_ms")}
            o = out[kind]
            log(f"  serving {kind}: +{_fmt(o['request_overhead_ms'])} ms per request "
                f"(max_tokens=1: +{_fmt(o['prefill_only_overhead_ms'])}), "
                f"+{_fmt(o['token_overhead_ms'])} ms per token")
    finally:
        stop_ray(started)
    return out


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _decode_loop(model: str, block_size: int, batch: int, ctx: int, steps: int, barrier, q) -> None:
    import torch

    from engine.engine import EngineConfig, LLMEngine
    from engine.sampling import SamplingParams

    torch.set_num_threads(1)  # as every worker (runtime.actor)
    engine = LLMEngine(EngineConfig(model=model, block_size=block_size, device="cpu", num_blocks=512))
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    ids = [engine.add_request([1 + (i * 7 + j) % 100 for i in range(ctx)], params) for j in range(batch)]
    while any(not engine.requests[i].seqs[0].output_ids for i in ids):
        engine.step()  # every prompt prefilled
    for _ in range(5):
        engine.step()  # warm-up
    barrier.wait(timeout=120)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
    q.put(statistics.median(times))


def measure_contention(cfg, log=print, batch: int = 8, ctx: int = 128) -> dict:
    """Median decode step (batch x ctx) of one engine process alone, then of two stepping at once."""
    import multiprocessing as mp

    spawn = mp.get_context("spawn")

    def run(n: int) -> list[float]:
        barrier, q = spawn.Barrier(n), spawn.Queue()
        args = (cfg.model, cfg.block_size, batch, ctx, cfg.contention_steps, barrier, q)
        procs = [spawn.Process(target=_decode_loop, args=args) for _ in range(n)]
        for p in procs:
            p.start()
        try:
            return [q.get(timeout=180) for _ in procs]
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.terminate()

    alone = run(1)[0]
    together = statistics.mean(run(2))
    factor = max(0.0, together / alone - 1.0)
    log(f"  contention: decode step {batch}x{ctx} alone {alone:.2f} ms, two at once {together:.2f} ms "
        f"-> contention {factor:.2f}")
    return {"batch": batch, "context_tokens": ctx, "alone_step_ms": alone, "together_step_ms": together,
            "contention": factor}
