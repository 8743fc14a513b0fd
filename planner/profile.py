"""`pdserve profile`: what a performance model of serving needs, measured on this machine for one
model, block size and device, as JSON. Prefill: the time to a prompt's first token (max_tokens=1,
one request alone) against prompt length and the part of it already in the prefix cache (the
prefix is run first, so its full blocks are cached). Decode: one engine step's time against batch
size and total context (every sequence of the batch prefilled first, then steps timed). Migration:
pool -> pool time against payload bytes over the chosen transport, from `measure.migrate` with this
model's KV layout (a receiver in another process). Fits: prefill ms per uncached token, decode ms
per step + per sequence, migration fixed ms + ms per byte; and from them the crossover
`local_prefill_max_tokens`, the uncached length below which prefilling on the decode worker costs
it less than receiving the KV (coordinator.decide explains the model). Bounded: `QUICK` measures
a few points with few repeats, and every point is one short engine run. The engine is timed with
`threads` torch threads (1, as every worker). Unless `serving` is off, planner.profile_serving also
measures the serving path (colocated and disaggregated, real clusters: per request, per computed
prompt token, the cold cost after idling, per token; `fits.serving`, planner.serving) and the
contention of two workers streaming at once (`fits.contention`, what the planner applies; the bare
engines' own, planner.profile_contention, beside it as `fits.contention_engines`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ProfileConfig:
    """model / block_size / device: the engine measured. prompt_lens: prefill points; cached_fractions:
    parts of each prompt cached first; batch_sizes x contexts: decode points (context: tokens per
    sequence); decode_steps: timed steps per decode point; repeats: runs per prefill point (the fastest
    counts, the median is recorded beside it);
    transport: a measure.migrate transport (zmq-tcp, zmq-ipc, ray...); migrate_tokens: its points."""

    model: str = "smollm2"  # as `pdserve up`; 'tiny' for tests and smoke runs
    weights: str = "f32"  # the engine's weight format (`pdserve profile`: pdserve_cli.weights_arg's default)
    block_size: int = 16
    device: str = "cpu"
    prompt_lens: tuple[int, ...] = (16, 64, 256, 512, 1024)
    cached_fractions: tuple[float, ...] = (0.0, 0.5, 0.9)
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    contexts: tuple[int, ...] = (64, 512)
    decode_steps: int = 8
    repeats: int = 5
    transport: str = "zmq-tcp"
    migrate_tokens: tuple[int, ...] = (16, 64, 256, 1024)
    migrate_repeats: int = 8
    quick: bool = False
    serving: bool = True   # also the serving path's overheads and contention (planner.profile_serving)
    serving_prompt_lens: tuple[int, ...] = (16, 64, 256, 512, 1024)
    serving_max_tokens: int = 32
    serving_repeats: int = 4           # back-to-back requests per length (prefill-only, and full)
    serving_gaps_ms: tuple[float, ...] = (10, 25, 50, 100, 200, 400)  # idle before an isolated request
    serving_isolated_repeats: int = 3  # isolated requests per (length, gap)
    serving_loaded_rate: float = 15.0  # req/s of the loaded phase: the serving processes' CPU under load
    serving_loaded_requests: int = 60  # requests in it (Poisson arrivals, the lengths above in turn)
    contention_steps: int = 60
    serving_contention_repeats: int = 5  # alternated pairs (one stream, two at once) of the served contention
    threads: int | None = 1  # torch threads while timing the engine: 1, as every worker (runtime.actor)


QUICK = ProfileConfig(prompt_lens=(16, 64, 256, 512), cached_fractions=(0.0, 0.75), batch_sizes=(1, 8),
                      contexts=(128,), decode_steps=5, repeats=5, migrate_tokens=(16, 128, 512),
                      migrate_repeats=5, quick=True, serving_prompt_lens=(16, 128, 512, 1024),
                      serving_max_tokens=16, serving_repeats=3, serving_gaps_ms=(20, 60, 300),
                      serving_isolated_repeats=3, serving_loaded_requests=45, contention_steps=40)


def _engine(cfg: ProfileConfig):
    from engine.engine import EngineConfig, LLMEngine

    blocks = max(cfg.batch_sizes) * (max(cfg.contexts) // cfg.block_size + 4) \
        + 4 * (max(cfg.prompt_lens) // cfg.block_size + 2)
    return LLMEngine(EngineConfig(model=cfg.model, block_size=cfg.block_size, device=cfg.device,
                                  num_blocks=max(512, blocks), weights=cfg.weights))


def _ids(rng, n: int, vocab: int) -> list[int]:
    return [int(x) for x in rng.integers(1, min(vocab, 256), size=n)]


def profile_prefill(engine, cfg: ProfileConfig, rng) -> list[dict]:
    from engine.sampling import SamplingParams

    one, vocab, rows = SamplingParams(max_tokens=1), engine.model_config.vocab_size, []
    engine.generate([_ids(rng, 32, vocab)], one)  # warm-up
    for n in cfg.prompt_lens:
        for frac in cfg.cached_fractions:
            times, cached = [], 0
            for _ in range(cfg.repeats):
                prompt = _ids(rng, n, vocab)  # fresh each time: nothing cached but what we put there
                prefix = prompt[:int(n * frac)]
                if len(prefix) >= cfg.block_size:
                    engine.generate([prefix + [1]], one)  # its full blocks stay in the prefix cache
                hits, t0 = engine.kv.prefix_hit_tokens, time.perf_counter()
                engine.generate([prompt], one)
                times.append((time.perf_counter() - t0) * 1e3)
                cached = engine.kv.prefix_hit_tokens - hits
            # the fastest run is the cost; slower ones met another process on the shared cores
            rows.append({"prompt_tokens": n, "cached_tokens": cached, "uncached_tokens": n - cached,
                         "ms": min(times), "ms_median": statistics.median(times)})
    return rows


def profile_decode(engine, cfg: ProfileConfig, rng) -> list[dict]:
    from engine.sampling import SamplingParams

    vocab, rows = engine.model_config.vocab_size, []
    for batch in cfg.batch_sizes:
        for ctx in cfg.contexts:
            params = SamplingParams(max_tokens=cfg.decode_steps + 4, ignore_eos=True)
            ids = [engine.add_request(_ids(rng, ctx, vocab), params) for _ in range(batch)]
            while any(not engine.requests[i].seqs[0].output_ids for i in ids if i in engine.requests):
                engine.step()  # every prompt prefilled (its first token out)
            times = []
            for _ in range(cfg.decode_steps):
                t0 = time.perf_counter()
                engine.step()
                times.append((time.perf_counter() - t0) * 1e3)
            for i in ids:
                engine.abort(i)
            rows.append({"batch": batch, "context_tokens": ctx, "total_context": batch * ctx,
                         "step_ms": min(times), "step_ms_median": statistics.median(times)})
    return rows


def profile_migration(engine, cfg: ProfileConfig, log) -> list[dict]:
    from measure.migrate import BenchConfig, run_bench

    m = engine.model_config
    dtype = str(engine.storage.data.dtype).replace("torch.", "")
    shape = f"{m.num_layers},{m.num_kv_heads},{m.head_dim},{dtype}"
    bench = BenchConfig(kv_shapes=(shape,), tokens=cfg.migrate_tokens, block_sizes=(cfg.block_size,),
                        transports=(cfg.transport,), repeats=cfg.migrate_repeats, warmup=2, baselines=False,
                        small_repeats=cfg.migrate_repeats, small_warmup=2, device=cfg.device)
    rows = run_bench(bench, log=lambda s: None)["results"]
    return [{"tokens": r["tokens"], "bytes": r["bytes"], "ms": r["latency_ms_p50"]} for r in rows]


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of a least-squares line (slope 0 for a single point)."""
    if len(set(xs)) < 2:
        return (float(np.mean(ys)) if ys else 0.0), 0.0
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(intercept), float(slope)


def crossover(prefill_ms_per_token: float, migration_fixed_ms: float,
              migration_ms_per_token: float) -> int | None:
    """Uncached tokens below which a local prefill costs less than receiving the KV: p*L <= m0 + m1*L
    (None: local prefill is never costlier per token, so only the decode worker's load limits it)."""
    if prefill_ms_per_token <= migration_ms_per_token:
        return None
    return max(0, int(migration_fixed_ms / (prefill_ms_per_token - migration_ms_per_token)))


def run_profile(cfg: ProfileConfig, log=print) -> dict:
    import torch

    t0, threads = time.perf_counter(), torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg, log, t0)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: ProfileConfig, log, t0: float) -> dict:
    from measure.machine import describe

    rng = np.random.default_rng(0)
    engine = _engine(cfg)
    log("prefill ...")
    prefill = profile_prefill(engine, cfg, rng)
    log("decode ...")
    decode = profile_decode(engine, cfg, rng)
    log(f"migration over {cfg.transport} ...")
    migration = profile_migration(engine, cfg, log)
    p0, p = _fit([r["uncached_tokens"] for r in prefill], [r["ms"] for r in prefill])
    d0, d_seq = _fit([r["batch"] for r in decode], [r["step_ms"] for r in decode])
    _, d_ctx = _fit([r["total_context"] for r in decode], [r["step_ms"] for r in decode])
    m0, m_byte = _fit([r["bytes"] for r in migration], [r["ms"] for r in migration])
    token_bytes = migration[-1]["bytes"] / migration[-1]["tokens"] if migration else 0.0
    fits = {"prefill_fixed_ms": p0, "prefill_ms_per_token": p, "decode_step_fixed_ms": d0,
            "decode_ms_per_sequence": d_seq, "decode_ms_per_context_token": d_ctx,
            "migration_fixed_ms": m0, "migration_ms_per_byte": m_byte, "kv_bytes_per_token": token_bytes,
            "migration_ms_per_token": m_byte * token_bytes}
    fits["local_prefill_max_tokens"] = crossover(p, m0, fits["migration_ms_per_token"])
    report = {"config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
              "machine": describe(engine, bandwidth=not cfg.quick), "prefill": prefill, "decode": decode,
              "migration": migration, "fits": fits}
    if cfg.serving:
        _serving(report, cfg, log)
    report["seconds"] = time.perf_counter() - t0
    return report


def _serving(report: dict, cfg: ProfileConfig, log) -> None:
    """The serving path's overheads per configuration kind and the contention factor, into
    `report['serving']`, `report['contention']` and the fits the planner reads."""
    from planner.model import from_profile
    from planner.profile_contention import measure_contention
    from planner.profile_serving import KINDS, measure_serving
    from planner.serving import ServingPath

    log("contention (two engines stepping at once) ...")
    report["contention"] = measure_contention(cfg, log)
    log("serving path (sequential requests through real clusters) ...")
    report["serving"] = s = measure_serving(cfg, from_profile(report), log)
    f = report["fits"]
    f["serving"] = {k: {**{x: s[k]["fit"].get(x, 0.0) for x in ServingPath.__dataclass_fields__},
                        "cpu_ms": s[k]["loaded"]["cpu_ms_per_request"]} for k in KINDS}
    f["request_overhead_ms"] = {k: s[k]["request_overhead_ms"] for k in KINDS}  # back to back, median
    f["token_overhead_ms"] = {k: s[k]["token_overhead_ms"] for k in KINDS}
    # the planner applies the contention measured serving (two workers streaming, planner.profile_serving
    # .served_contention) where it was measured; the engines' own is kept beside it
    f["contention_engines"] = report["contention"]["contention"]
    served = (s.get("colocated", {}).get("served_contention") or {}).get("contention")
    f["contention"] = f["contention_engines"] if served is None else served


def format_profile(report: dict) -> str:
    c = report["config"]
    f, lines = report["fits"], [f"model {c['model']}, {c.get('weights', 'f32')} weights, block size "
                                f"{c['block_size']}, {c['device']}",
                                "prefill (max_tokens=1): tokens / cached -> ms"]
    lines += [f"  {r['prompt_tokens']:6d} / {r['cached_tokens']:5d} -> {r['ms']:8.2f}"
              for r in report["prefill"]]
    lines.append("decode step: batch x context -> ms")
    lines += [f"  {r['batch']:4d} x {r['context_tokens']:5d} -> {r['step_ms']:8.2f}"
              for r in report["decode"]]
    lines.append(f"migration ({report['config']['transport']}): tokens / bytes -> ms")
    lines += [f"  {r['tokens']:6d} / {r['bytes']:9d} -> {r['ms']:8.2f}" for r in report["migration"]]
    lines.append(f"fits: prefill {f['prefill_fixed_ms']:.2f} ms + {f['prefill_ms_per_token']:.4f} ms/token; "
                 f"decode step {f['decode_step_fixed_ms']:.2f} ms + {f['decode_ms_per_sequence']:.3f} ms/seq;"
                 " "
                 f"migration {f['migration_fixed_ms']:.2f} ms + {f['migration_ms_per_token']:.4f} ms/token")
    lines.append(f"suggested local_prefill_max_tokens (ClusterConfig): {f['local_prefill_max_tokens']} "
                 f"(prefill_ms_per_token {f['prefill_ms_per_token']:.4f})")
    from planner.serving import from_fits

    for kind in (f.get("serving") or f.get("request_overhead_ms") or {}):
        lines.append(f"serving path ({kind}): {from_fits(f, kind).describe()}")
    if "contention" in f:
        c = report["contention"]
        lines.append(f"contention of the engines: step {c['alone_step_ms']:.2f} ms alone, "
                     f"{c['together_step_ms']:.2f} ms with another engine stepping -> "
                     f"{f.get('contention_engines', f['contention']):.2f} per other busy engine")
        sc = (report.get("serving", {}).get("colocated") or {}).get("served_contention")
        if sc and sc["contention"] is not None:
            lines.append(f"contention serving: TPOT {statistics.median(sc['alone_tpot_ms']):.2f} ms with one "
                         f"worker streaming, {statistics.median(sc['together_tpot_ms']):.2f} ms with two -> "
                         f"{sc['contention']:.2f} per other busy engine (the planner's)")
    return "\n".join(lines)

