"""`pdserve bench serve`: disaggregated (KV migration streamed during the prefill, and whole after
it, both in one invocation unless --streamed/--no-streamed picks one) vs colocated vs per-request
(each prompt prefilled on the decode worker or migrated, coordinator.decide) serving under
the same open-loop Poisson load, from a load client in its own process (TTFT, TPOT, ITL, e2e
percentiles, throughput, goodput under SLOs, KV migration share of TTFT, streamed overlap, and the
max_tokens=1 overhead measurement); writes JSON and a plot."""

from __future__ import annotations

from transfer.registry import names as transport_names

NAME = "serve"
HELP = "benchmark serving: disaggregated vs colocated vs per-request, TTFT/TPOT/goodput under Poisson load"
GROUP = "bench"


PRESETS = ("long-prompt-short-output", "short-prompt-long-output", "mixed")  # loadgen's, bench.serve_mixed


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def add_arguments(p) -> None:
    import argparse

    p.add_argument("--quick", action="store_true",
                   help="3 rates x 40 requests per setup (p99 then close to the max; the full run sends 200)")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot TTFT and TPOT p50/p99 against rate")
    p.add_argument("--rates", type=_floats, help="comma-separated request rates in req/s (e.g. 1,2,4)")
    p.add_argument("--num-requests", type=int, help="requests per rate and mode")
    p.add_argument("--preset", choices=PRESETS, help="length distributions (default long-prompt-...)")
    p.add_argument("--modes", help="comma-separated: disaggregated,colocated,per_request (default all three)")
    p.add_argument("--streamed", action=argparse.BooleanOptionalAction, default=None,
                   help="disaggregated with KV migration streamed during the prefill only (--streamed) or "
                        "whole after it only (--no-streamed); default: both, each its own labelled run")
    p.add_argument("--step-budget", type=int, metavar="TOKENS",
                   help="tokens per engine step in every mode (default 512: long prompts prefill in chunks)")
    p.add_argument("--transport", choices=transport_names(), help="KV migration transport (default zmq)")
    p.add_argument("--url", help="target a running coordinator instead of bringing clusters up")
    p.add_argument("--mode", choices=("disaggregated", "colocated", "per_request"),
                   help="the --url coordinator's mode")
    p.add_argument("--ttft-slo-ms", type=float, help="goodput TTFT SLO in ms")
    p.add_argument("--tpot-slo-ms", type=float, help="goodput TPOT SLO in ms")
    p.add_argument("--seed", type=int, help="base seed of arrivals, lengths and prompts")
    p.add_argument("--detailed", action="store_true", help="also write every request's record to the JSON")


def run(args) -> int:
    import json
    from dataclasses import replace

    from bench.serve import QUICK, ServeBenchConfig, run_bench
    from bench.serve_report import format_goodput, format_overhead, format_table

    cfg = QUICK if args.quick else ServeBenchConfig()
    over: dict = {}
    if args.rates:
        over["rates"] = args.rates
    if args.num_requests:
        over["num_requests"] = args.num_requests
    if args.preset:
        over["preset"] = args.preset
    if args.modes:
        over["modes"] = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if args.transport:
        over["transport"] = args.transport
    if args.streamed is not None:
        over["streamed"] = (args.streamed,)
    if args.step_budget:
        over["step_budget"] = args.step_budget
    if args.url:
        over["url"] = args.url
        if not args.mode:
            print("--url needs --mode disaggregated|colocated (the mode of that coordinator)")
            return 2
    if args.mode:
        over["mode"] = args.mode
    if args.ttft_slo_ms is not None or args.tpot_slo_ms is not None:
        s = cfg.slo
        over["slo"] = replace(s, ttft_ms=args.ttft_slo_ms if args.ttft_slo_ms is not None else s.ttft_ms,
                              tpot_ms=args.tpot_slo_ms if args.tpot_slo_ms is not None else s.tpot_ms)
    if args.detailed:
        over["detailed"] = True
    if args.seed is not None:
        over["seed"] = args.seed
    try:
        cfg = replace(cfg, **over)
    except ValueError as e:
        print(f"bad arguments: {e}")
        return 2
    from bench.serve import label, p99_note, setups

    where = cfg.url or (f"local Ray, setups {', '.join(label(m, s) for m, s in setups(cfg))}; "
                        f"step budget {cfg.step_budget} tokens in every engine")
    print(f"bench serve: {where}; preset {cfg.preset}; rates {list(cfg.rates)} req/s; {cfg.num_requests} "
          f"requests each; SLO TTFT {cfg.slo.ttft_ms:g} ms, TPOT {cfg.slo.tpot_ms:g} ms; load client in "
          f"its own process", flush=True)
    report = run_bench(cfg, log=lambda s: print(s, flush=True))
    print(format_table(report))
    print("\nGoodput (req/s meeting both SLOs; % of requests) per rate:")
    print(format_goodput(report))
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
        from bench.serve_report import plot

        plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0 if all(r["failed"] == 0 for r in report["runs"]) else 1
