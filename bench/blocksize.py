"""`pdserve bench blocksize`: does the block size that minimises KV waste also minimise time per
output token (TPOT) and migration time? For every block size B, at one KV capacity in tokens
(num_blocks = capacity // B), three traces replay on the real engine (`bench.blocksize_replay`:
the shipped seed trace and a mixed-length trace, each beside the allocator simulator, and a
shared-prefix trace of n > 1 requests), the prompts of the mixed trace migrate over ZeroMQ at B and
between unequal sizes (`bench.blocksize_migrate`), and `bench.blocksize_report` turns it into the
JSON, the figure and the answer. `run` is the orchestration; progress goes to stderr.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class BlocksizeConfig:
    """What `run` measures.

    sizes: block sizes (token slots per block) to compare.
    model: engine model spec ('tiny' = the built-in random test model, 'smollm2', a path...).
    capacity_tokens: KV capacity of the mixed and shared traces (the seed trace keeps its own 80).
    mixed_requests / mixed_prompt / mixed_output / mixed_gap: the mixed trace: request count,
        prompt and output length ranges (log-uniform, inclusive) and mean steps between arrivals.
    shared_groups / shared_requests / shared_prefix / shared_suffix / shared_n / shared_output:
        the shared-prefix trace: prefix groups, requests over all groups, prefix length, unique
        suffix length range, samples per request (temperature 0.8) and tokens per sample.
    max_batched_tokens: engine step budget (decode tokens plus prefill chunks).
    repeats: runs of the mixed trace per size (medians reported; sizes interleaved per repeat).
    migrate_sequences / migrate_repeats: mixed-trace prompts migrated per size, and repeats.
    reblock_pairs: (prefill B, decode B) pairs migrated besides the equal sizes.
    seed: RNG seed of every generated trace.
    """

    sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    model: str = "tiny"
    capacity_tokens: int = 6144
    mixed_requests: int = 64
    mixed_prompt: tuple[int, int] = (8, 768)
    mixed_output: tuple[int, int] = (4, 160)
    mixed_gap: float = 2.0
    shared_groups: int = 3
    shared_requests: int = 18
    shared_prefix: int = 100
    shared_suffix: tuple[int, int] = (4, 40)
    shared_n: int = 4
    shared_output: int = 24
    max_batched_tokens: int = 512
    repeats: int = 5
    migrate_sequences: int = 8
    migrate_repeats: int = 5
    reblock_pairs: tuple[tuple[int, int], ...] = ((16, 32), (32, 16), (1, 128), (128, 8))
    seed: int = 0


def quick(cfg: BlocksizeConfig) -> tuple[BlocksizeConfig, list[str]]:
    """The --quick variant of `cfg` and a description of what it shortened."""
    q = dataclasses.replace(cfg, mixed_requests=min(cfg.mixed_requests, 32), capacity_tokens=4096,
                            mixed_prompt=(8, 512), shared_requests=min(cfg.shared_requests, 9),
                            repeats=3, migrate_sequences=min(cfg.migrate_sequences, 4), migrate_repeats=3)
    changed = [f"{f.name}: {getattr(cfg, f.name)} -> {getattr(q, f.name)}" for f in dataclasses.fields(cfg)
               if getattr(cfg, f.name) != getattr(q, f.name)]
    return q, changed


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)




def _engine(cfg: BlocksizeConfig, loaded, block_size: int, capacity: int, prefix_caching: bool,
            mirror: bool = True):
    from engine.engine import EngineConfig, LLMEngine
    from engine.scheduler import SchedulerConfig

    return LLMEngine(EngineConfig(model=cfg.model, block_size=block_size, num_blocks=capacity // block_size,
                                  num_host_blocks=0, enable_prefix_caching=prefix_caching,
                                  attention_backend="torch", decode_mirror=mirror,
                                  scheduler=SchedulerConfig(max_num_batched_tokens=cfg.max_batched_tokens)),
                     loaded=loaded)


def _warm(eng) -> None:
    """One short untimed generation (first-touch costs), its blocks then evicted from the cache."""
    from engine.sampling import SamplingParams

    eng.generate([[5] * 9, [6] * 20], SamplingParams(max_tokens=3, ignore_eos=True))
    eng.kv.allocator.evict_cached()


def _median_run(runs: list[dict]) -> dict:
    """Counts from the first run (they do not depend on timing); timings as medians over runs."""
    out = dict(runs[0])
    for key in ("wall_s", "tokens_per_s", "tpot_ms", "alloc_us_per_step", "attn_ms_per_step",
                "attn_ms_per_prefill_token"):
        vals = [r[key] for r in runs if r[key] is not None]
        out[key] = statistics.median(vals) if vals else None
    out["repeats"] = len(runs)
    return out


def run(cfg: BlocksizeConfig, json_path: str | None = None, plot_path: str | None = None,
        shortened: list[str] | None = None) -> dict:
    """Measure every block size; write the JSON and the figure when paths are given; return the report."""
    from allocsim.scenario import load_default_scenario
    from bench.blocksize_migrate import measure_migrations
    from bench.blocksize_replay import engine_trace, mixed_scenario, replay, shared_trace, simulate
    from bench.blocksize_report import build_report, write_outputs
    from engine.attention import get_backend
    from engine.loader import load_model

    loaded = load_model(cfg.model, device="cpu", dtype=None, backend=get_backend("torch"))
    vocab = loaded[1].vocab_size
    seed_sc, mixed_sc = load_default_scenario(), mixed_scenario(cfg)
    traces = {"seed": engine_trace(seed_sc, vocab, cfg.seed),
              "mixed": engine_trace(mixed_sc, vocab, cfg.seed + 2), "shared": shared_trace(cfg, vocab)}
    log(f"model {cfg.model}; sizes {list(cfg.sizes)}; seed trace {len(seed_sc.requests)} requests in "
        f"{seed_sc.capacity} slots; mixed {len(traces['mixed'])} and shared {len(traces['shared'])} "
        f"(n={cfg.shared_n}) requests in {cfg.capacity_tokens} slots; {cfg.repeats} timed repeat(s)")
    per: dict[int, dict] = {}
    layout = None
    for k, B in enumerate(cfg.sizes):
        sim = {"seed": simulate(seed_sc, B), "mixed": simulate(mixed_sc, B)}
        res = {}
        if seed_sc.capacity >= B:
            res["seed"] = replay(_engine(cfg, loaded, B, seed_sc.capacity, False), traces["seed"])
        else:
            n = len(seed_sc.requests)
            res["seed"] = {"admitted": 0, "rejected": n, "requests": n, "completed": 0, "preemptions": 0,
                           "peak_reserved": 0, "peak_waste": 0, "waste_series": [],
                           "note": f"{seed_sc.capacity} slots hold no {B}-slot block"}
        # NOTE: one step may prefill the whole trace here, so no prompt is chunked and admission
        # is never deferred by the token budget: the configuration the simulator models.
        whole = dataclasses.replace(cfg, max_batched_tokens=cfg.capacity_tokens)
        res["mixed_unchunked"] = replay(_engine(whole, loaded, B, cfg.capacity_tokens, False),
                                        traces["mixed"])
        eng = _engine(cfg, loaded, B, cfg.capacity_tokens, False, mirror=False)  # decode walks the table
        _warm(eng)
        res["mixed_gather"] = replay(eng, traces["mixed"])
        eng = _engine(cfg, loaded, B, cfg.capacity_tokens, True)
        layout = eng.storage.layout
        _warm(eng)
        res["shared"] = replay(eng, traces["shared"])
        per[B] = {"sim": sim, "traces": res, "mixed_runs": []}
        log(f"[{k + 1}/{len(cfg.sizes)}] B={B}: peak waste engine/sim: seed {res['seed']['peak_waste']}/"
            f"{sim['seed']['peak_waste']}, mixed unchunked {res['mixed_unchunked']['peak_waste']}/"
            f"{sim['mixed']['peak_waste']}; shared hit rate {res['shared']['prefix_hit_rate']:.2f}, "
            f"cow {res['shared']['cow_bytes']} B")
    for rep in range(cfg.repeats):  # sizes interleaved, alternating direction, to spread machine noise
        for B in (cfg.sizes if rep % 2 == 0 else cfg.sizes[::-1]):
            eng = _engine(cfg, loaded, B, cfg.capacity_tokens, False)
            _warm(eng)
            r = replay(eng, traces["mixed"])
            per[B]["mixed_runs"].append(r)
            log(f"mixed repeat {rep + 1}/{cfg.repeats} B={B}: TPOT {r['tpot_ms']:.2f} ms, "
                f"{r['tokens_per_s']:.0f} tok/s, waste {r['peak_waste']}, preemptions {r['preemptions']}")
    for B in cfg.sizes:
        per[B]["traces"]["mixed"] = _median_run(per[B].pop("mixed_runs"))
    lengths = [len(r.prompt) for r in traces["mixed"][:cfg.migrate_sequences]]
    migrations = measure_migrations(layout, cfg.sizes, cfg.reblock_pairs, lengths, cfg.migrate_repeats,
                                    cfg.seed, log)
    report = build_report(cfg, per, migrations, lengths, shortened or [])
    write_outputs(report, json_path, plot_path, log)
    return report
