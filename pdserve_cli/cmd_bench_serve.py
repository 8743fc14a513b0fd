"""`pdserve bench serve`: disaggregated (KV migration streamed during the prefill, and whole after
it, both in one invocation unless --streamed/--no-streamed picks one) vs colocated (at several chunk
budgets, the best one the baseline) vs per-request (each prompt prefilled on the decode worker or
migrated, coordinator.decide) serving on the real model (SmolLM2; --model tiny for smoke runs)
under the same open-loop Poisson load or a Mooncake trace, from a load client in its own process:
goodput by a search over rates (>= 90% of requests within SLOs scaled to the unloaded TTFT and
TPOT), TTFT, TPOT, ITL, e2e percentiles, throughput, KV migration share of TTFT, streamed overlap,
and the max_tokens=1 overhead measurement; writes JSON and a plot."""

from __future__ import annotations

from pdserve_cli import transport_arg

NAME = "serve"
HELP = "benchmark serving: disaggregated vs colocated vs per-request, TTFT/TPOT/goodput under Poisson load"
GROUP = "bench"


PRESETS = ("long-prompt-long-output", "short-prompt-long-output", "long-prompt-short-output",
           "mixed")  # loadgen's, measure.serve_mixed


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def add_arguments(p) -> None:
    import argparse

    from measure.serve_slo import TPOT_MULTIPLE, TTFT_MULTIPLE

    p.add_argument("--quick", action="store_true",
                   help="the mixed preset, 20 requests per search step, 4 steps, colocated at chunk budgets "
                        "128 and 512, streamed disaggregation only (sized to finish within 15 minutes on "
                        "SmolLM2 on 2 cores; docs/benchmarks-serving.md)")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot TTFT and TPOT p50/p99 against rate")
    p.add_argument("--model", help="'smollm2' (default: the results' model), 'tiny' (tests, smoke runs), a "
                   ".gguf file or a checkpoint directory")
    weights_help = "engine weight format (default: gguf for GGUF models, bf16 otherwise; tiny: f32)"
    p.add_argument("--weights", choices=("f32", "bf16", "int8", "gguf", "gguf-q8"), help=weights_help)
    p.add_argument("--rates", type=_floats,
                   help="comma-separated fixed request rates in req/s (e.g. 1,2,4) instead of the goodput "
                        "search")
    p.add_argument("--num-requests", type=int, help="requests per rate (per search step) and setup")
    p.add_argument("--search-steps", type=int, help="measurements per goodput search (default 6; quick 4)")
    p.add_argument("--search-start", type=float, metavar="REQ_S",
                   help="the search's first rate (default: from the unloaded times)")
    p.add_argument("--preset", choices=PRESETS, help="length distributions (default long-prompt-long-output)")
    p.add_argument("--trace", metavar="FILE.jsonl", help="replay a Mooncake JSONL trace (timestamp ms, "
                   "input_length, output_length, hash_ids) instead of a preset, e.g. "
                   "measure/traces/small.jsonl")
    p.add_argument("--time-scale", type=float, help="with --trace: replay at this time scale (2: half the "
                   "trace's rate) once, instead of the goodput search")
    p.add_argument("--modes", help="comma-separated: colocated,disaggregated,per_request (default all three)")
    p.add_argument("--streamed", action=argparse.BooleanOptionalAction, default=None,
                   help="disaggregated with KV migration streamed during the prefill only (--streamed) or "
                        "whole after it only (--no-streamed); default: both, each its own labelled run")
    p.add_argument("--step-budget", type=int, metavar="TOKENS",
                   help="tokens per engine step of the disaggregated engines (default 512)")
    p.add_argument("--colocated-budgets", type=_ints, metavar="T1,T2",
                   help="the colocated mode's chunk budgets, one setup each; the best is the baseline "
                        "(default 128,256,512)")
    p.add_argument("--decide-profile", metavar="FILE", help="a `pdserve profile --json` file pricing the "
                   "per-request mode's decisions (default: each decode worker's own startup timing)")
    p.add_argument("--no-pin", action="store_true",
                   help="leave workers unpinned (default: one thread each, on a core of its own)")
    transport_arg.add(p)
    p.add_argument("--url", help="target a running coordinator instead of bringing clusters up")
    p.add_argument("--mode", choices=("disaggregated", "colocated", "per_request"),
                   help="the --url coordinator's mode")
    p.add_argument("--ttft-slo-ms", type=float, help="a fixed TTFT SLO in ms (default: scaled)")
    p.add_argument("--tpot-slo-ms", type=float, help="a fixed TPOT SLO in ms (default: scaled)")
    p.add_argument("--ttft-slo-scale", type=float, help=f"TTFT SLO = this x the unloaded TTFT p50 measured "
                   f"at the start (default {TTFT_MULTIPLE:g})")
    p.add_argument("--tpot-slo-scale", type=float, help=f"TPOT SLO = this x the unloaded TPOT p50 (the "
                   f"decode step alone) measured at the start (default {TPOT_MULTIPLE:g})")
    p.add_argument("--seed", type=int, help="base seed of arrivals, lengths and prompts")
    p.add_argument("--detailed", action="store_true", help="also write every request's record to the JSON")


def _overrides(args, cfg) -> dict:
    """ServeBenchConfig fields the flags set (ValueError for a bad combination)."""
    from dataclasses import replace

    over: dict = {}
    for flag, field in (("rates", "rates"), ("num_requests", "num_requests"), ("preset", "preset"),
                        ("transport", "transport"), ("step_budget", "step_budget"), ("url", "url"),
                        ("mode", "mode"), ("model", "model"), ("weights", "weights"), ("trace", "trace"),
                        ("search_steps", "search_steps"), ("search_start", "search_start"),
                        ("colocated_budgets", "colocated_budgets"), ("decide_profile", "decide_profile")):
        v = getattr(args, flag)
        if v:
            over[field] = v
    if args.seed is not None:
        over["seed"] = args.seed
    if args.modes:
        over["modes"] = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if args.streamed is not None:
        over["streamed"] = (args.streamed,)
    if args.no_pin:
        over["pin_workers"] = False
    if args.detailed:
        over["detailed"] = True
    if args.url and not args.mode:
        raise ValueError("--url needs --mode disaggregated|colocated|per_request (that coordinator's mode)")
    if args.time_scale is not None:
        if not args.trace:
            raise ValueError("--time-scale replays a --trace")
        if not args.time_scale > 0:
            raise ValueError(f"--time-scale must be > 0, got {args.time_scale}")
        from measure.serve_trace import mean_rate, read_mooncake

        n = args.num_requests or cfg.num_requests
        over["rates"] = (mean_rate(read_mooncake(args.trace)[:n]) / args.time_scale,)
    fixed, scale = cfg.slo, cfg.slo_scale
    if args.ttft_slo_ms is not None:
        fixed, scale = replace(fixed, ttft_ms=args.ttft_slo_ms), replace(scale, ttft=None)
    elif args.ttft_slo_scale is not None:
        scale = replace(scale, ttft=args.ttft_slo_scale)
    if args.tpot_slo_ms is not None:
        fixed, scale = replace(fixed, tpot_ms=args.tpot_slo_ms), replace(scale, tpot=None)
    elif args.tpot_slo_scale is not None:
        scale = replace(scale, tpot=args.tpot_slo_scale)
    over.update(slo=fixed, slo_scale=scale)
    return over


def run(args) -> int:
    import json
    from dataclasses import replace

    from measure.serve import QUICK, ServeBenchConfig, run_bench
    from measure.serve_report import format_goodput, format_goodput_search, format_overhead, format_table

    cfg = QUICK if args.quick else ServeBenchConfig()
    try:
        cfg = replace(cfg, **_overrides(args, cfg))
    except (ValueError, OSError) as e:
        print(f"bad arguments: {e}")
        return 2
    from measure.serve import p99_note, setups

    where = cfg.url or (f"local Ray, setups {', '.join(s.label for s in setups(cfg))}; chunk budget "
                        f"{cfg.step_budget} tokens (disaggregated); workers "
                        f"{'pinned, one core each' if cfg.pin_workers else 'unpinned'}")
    how = f"rates {list(cfg.rates)} req/s" if cfg.rates else f"goodput search, {cfg.search_steps} steps"
    print(f"bench serve: model {cfg.model}; {where}; {cfg.trace or cfg.preset}; {how}; {cfg.num_requests} "
          f"requests each; load client in its own process", flush=True)
    try:
        report = run_bench(cfg, log=lambda s: print(s, flush=True))
    except ValueError as e:  # an SLO that could not be scaled, a trace too short
        print(f"bench serve failed: {e}")
        return 1
    print(format_table(report))
    print("\nGoodput (req/s meeting both SLOs; % of requests) per rate:")
    print(format_goodput(report))
    print("\nGoodput (the highest rate at which >= 90% of requests meet both SLOs):")
    print(format_goodput_search(report))
    note = p99_note(cfg.num_requests)
    if note:
        print(f"\n{'quick: ' if cfg.quick else 'NOTE: '}{note}")
    if any(report["overhead"].values()):
        print("\nTTFT overhead at low load (requests one at a time; ms):")
        print(format_overhead(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot and report["runs"]:
        from measure.serve_report import plot

        plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0 if all(r["failed"] == 0 for r in report["runs"]) else 1
