"""`pdserve plan`: from a workload (a trace JSON, a bench preset, or prompt and output length
distributions at a set of rates), SLOs with an attainment target, a `pdserve profile` JSON and
worker budgets, simulate every configuration of each budget (colocated K; P prefill + D decode,
with coordinator.decide 'always' and 'auto') and print the best one, its predicted goodput and
TTFT/TPOT percentiles, whether disaggregation pays and why, and the per-request threshold; write
JSON and a goodput-vs-rate plot. `--validate` serves the configurations that fit this machine with
`bench serve` and prints predicted beside measured (bench.plan)."""

from __future__ import annotations

NAME = "plan"
GROUP = None
HELP = "predict goodput per configuration from a profile and pick P:D (or colocated); --validate measures"


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def add_arguments(p) -> None:
    p.add_argument("--profile", required=True, metavar="FILE", help="a `pdserve profile --json` file")
    p.add_argument("--trace", metavar="FILE", help="requests: [{arrival_s, prompt_tokens, output_tokens, "
                   "prefix_id?, prefix_tokens?}] (rescaled to each --rates value)")
    p.add_argument("--preset", help="bench serve's presets: long-prompt-short-output, "
                   "short-prompt-long-output, "
                   "mixed (default mixed unless --prompt/--output)")
    p.add_argument("--prompt", help="prompt lengths: fixed:N, uniform:LO:HI or "
                   "lognormal:MEDIAN:LO:HI[:SIGMA]")
    p.add_argument("--output", help="output lengths, same forms")
    p.add_argument("--rates", type=_floats, default=(1.0, 2.0, 3.0, 4.0, 6.0),
                   help="req/s (default 1,2,3,4,6)")
    p.add_argument("--num-requests", type=int, default=200, help="requests per simulated rate (default 200)")
    p.add_argument("--ttft-slo-ms", type=float, help="TTFT SLO (default bench serve's)")
    p.add_argument("--tpot-slo-ms", type=float, help="TPOT SLO (default bench serve's)")
    p.add_argument("--attainment", type=float, default=0.9, help="share of requests meeting both SLOs (0.9)")
    p.add_argument("--budget", type=_ints, default=(2,), help="worker budgets, comma-separated (default 2)")
    p.add_argument("--step-budget", type=int, default=512, help="tokens per engine step (default 512)")
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per engine (default 1024)")
    p.add_argument("--local-prefill-max-tokens", type=int, help="auto's limit (default ClusterConfig's)")
    p.add_argument("--contention", type=float, default=None,
                   help="step stretch per other busy engine on the same cores (default: the profile's "
                   "measured factor, 0 if it has none)")
    p.add_argument("--overhead-ms", type=float, default=0.0,
                   help="extra ms added to every TTFT, beyond the profile's measured serving overheads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the plan as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot predicted goodput against rate")
    p.add_argument("--validate", action="store_true", help="also run bench serve here and compare (minutes)")
    p.add_argument("--validate-requests", type=int, default=40, help="requests per measured rate (40)")
    p.add_argument("--resimulate", metavar="FILE", action="append", default=[],
                   help="a saved `plan --validate --json` file: predict its measured cells again with this "
                        "profile's model, no serving (repeatable)")


def _workload(args):
    from bench.plan import workload as w

    if args.trace:
        base = w.load_trace(args.trace)
        return (lambda rate: w.at_rate(base, rate)), base
    if args.prompt or args.output:
        pd, od = w.parse_dist(args.prompt or "fixed:128"), w.parse_dist(args.output or "fixed:32")
        at = lambda rate: w.from_distributions(pd, od, rate, args.num_requests, args.seed)  # noqa: E731
    else:
        at = lambda rate: w.from_preset(args.preset or "mixed", rate, args.num_requests, args.seed)  # noqa: E731
    return at, at(1.0)


def run(args) -> int:
    import json
    import statistics
    from dataclasses import replace

    from bench.plan.des import SimConfig
    from bench.plan.model import from_profile
    from bench.plan.report import format_plan, plot, to_json
    from bench.plan.search import Target, plan
    from bench.serve_metrics import SLO
    from coordinator.config import ClusterConfig

    if args.validate and (args.trace or args.prompt or args.output):
        print("--validate serves one of bench serve's presets (--preset), not a trace or --prompt/--output")
        return 2
    with open(args.profile) as f:
        model = from_profile(json.load(f), args.contention)
    s = SLO()
    slo = replace(s, ttft_ms=args.ttft_slo_ms or s.ttft_ms, tpot_ms=args.tpot_slo_ms or s.tpot_ms)
    local_max = args.local_prefill_max_tokens
    if local_max is None:
        local_max = ClusterConfig.__dataclass_fields__["local_prefill_max_tokens"].default
    base = SimConfig(step_budget=args.step_budget, block_size=model.block_size, num_blocks=args.num_blocks,
                     local_prefill_max_tokens=local_max, overhead_ms=args.overhead_ms)
    at, sample = _workload(args)
    median_prompt = int(statistics.median(r.prompt_tokens for r in sample))
    target = Target(slo, args.attainment)
    result = plan(at, model, args.budget, sorted(args.rates), target, base, median_prompt)
    threshold = {"local_prefill_max_tokens": local_max, "profile_crossover": model.crossover_tokens}
    print(f"SLO: TTFT {slo.ttft_ms:g} ms, TPOT {slo.tpot_ms:g} ms, attainment {args.attainment:.0%}; "
          f"contention {model.contention:g}; serving path: colocated {model.colocated.describe()}; "
          f"disaggregated {model.disaggregated.describe()}"
          + (f", extra {args.overhead_ms:g} ms" if args.overhead_ms else ""))
    print(format_plan(result, threshold))
    out = to_json(result, threshold, {"profile": args.profile, "rates": list(args.rates), "slo": vars(slo),
                                      "attainment": args.attainment, "contention": model.contention,
                                      "overhead_ms": args.overhead_ms, "median_prompt": median_prompt})
    if args.validate:
        from bench.plan.validate import format_validate, run_validate

        v = run_validate(model, args.rates, args.validate_requests, slo, model.contention or 1.0,
                         log=lambda m: print(m, flush=True), preset=args.preset or "mixed")
        print("\nvalidation (bench serve here, beside the model), ms and req/s")
        print(format_validate(v))
        out["validate"] = v
    for saved in args.resimulate:
        from bench.plan.validate import format_validate, resimulate

        with open(saved) as f:
            v = resimulate(model, json.load(f)["validate"], model.contention or 1.0)
        print(f"\nre-simulated {saved} (measured then, predicted now), ms and req/s")
        print(format_validate(v))
        out.setdefault("resimulated", {})[saved] = v
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"wrote {args.json}")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0
