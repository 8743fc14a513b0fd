"""`pdserve plan`: from a workload (a trace JSON, a bench preset, or prompt and output length
distributions at a set of rates), SLOs with an attainment target, a `pdserve profile` JSON and
worker budgets, simulate every configuration of each budget (colocated K; P prefill + D decode,
with coordinator.decide 'always' and 'auto') and print the best one, its predicted goodput and
TTFT/TPOT percentiles, whether disaggregation pays and why, and the per-request threshold; write
JSON and a goodput-vs-rate plot (every configuration its own marker and line style, so lines that
overlap stay visible). `--validate` serves the configurations that fit this machine with `bench
serve` (the profile's model, or --model) and prints predicted beside measured (planner).
Without --profile it uses profile-MODEL.json from this directory or out/ (MODEL: --model,
default smollm2), or says which command makes one. The SLOs, unless given in ms, are multiples
of the model's unloaded TTFT and TPOT for the workload (bench serve's scaling, measure.serve_slo)."""

from __future__ import annotations

NAME = "plan"
GROUP = None
HELP = "predict goodput per configuration from a profile and pick P:D (or colocated); --validate measures"
PROFILE_DIRS = (".", "out")


def profile_path(model: str) -> str | None:
    """The profile `plan` uses when --profile is not given: profile-MODEL.json in PROFILE_DIRS."""
    import os

    name = f"profile-{os.path.basename(model)}.json"
    return next((os.path.join(d, name) for d in PROFILE_DIRS if os.path.isfile(os.path.join(d, name))),
                None)


def profile_command(model: str) -> str:
    import os

    return f"pdserve profile --model {model} --json profile-{os.path.basename(model)}.json"


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def add_arguments(p) -> None:
    p.add_argument("--profile", metavar="FILE", help="a `pdserve profile --json` file (default: "
                   "profile-MODEL.json here or in out/)")
    p.add_argument("--model", help="the model of the default profile and the one --validate serves "
                   "(default: the profile's, else smollm2)")
    p.add_argument("--trace", metavar="FILE", help="requests: [{arrival_s, prompt_tokens, output_tokens, "
                   "prefix_id?, prefix_tokens?}], or a Mooncake JSONL trace (timestamp, input_length, "
                   "output_length, hash_ids; e.g. measure/traces/small.jsonl), rescaled to each --rates "
                   "value")
    p.add_argument("--preset", help="bench serve's presets: long-prompt-short-output, "
                   "short-prompt-long-output, "
                   "mixed (default mixed unless --prompt/--output)")
    p.add_argument("--prompt", help="prompt lengths: fixed:N, uniform:LO:HI or "
                   "lognormal:MEDIAN:LO:HI[:SIGMA]")
    p.add_argument("--output", help="output lengths, same forms")
    p.add_argument("--rates", type=_floats, default=(1.0, 2.0, 3.0, 4.0, 6.0),
                   help="req/s (default 1,2,3,4,6)")
    p.add_argument("--num-requests", type=int, default=200, help="requests per simulated rate (default 200)")
    p.add_argument("--ttft-slo-ms", type=float, help="a fixed TTFT SLO (default: scaled)")
    p.add_argument("--tpot-slo-ms", type=float, help="a fixed TPOT SLO (default: scaled)")
    p.add_argument("--ttft-slo-scale", type=float, default=5.0,
                   help="TTFT SLO = this x the model's unloaded TTFT of the median prompt (default 5)")
    p.add_argument("--tpot-slo-scale", type=float, default=2.0,
                   help="TPOT SLO = this x the model's unloaded decode step (default 2)")
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
    p.add_argument("--validate-search", type=int, metavar="STEPS",
                   help="with --validate: bench serve's goodput search, STEPS runs per configuration from "
                        "the lowest --rates value, instead of one run per rate; compares measured goodput "
                        "with the predicted sustained rate and the picks")
    p.add_argument("--resimulate", metavar="FILE", action="append", default=[],
                   help="a saved `plan --validate --json` file: predict its measured cells again with this "
                        "profile's model, no serving (repeatable)")


def _workload(args):
    from planner import workload as w

    if args.trace:
        base = w.load_trace(args.trace)
        return (lambda rate: w.at_rate(base, rate)), base
    if args.prompt or args.output:
        pd, od = w.parse_dist(args.prompt or "fixed:128"), w.parse_dist(args.output or "fixed:32")
        at = lambda rate: w.from_distributions(pd, od, rate, args.num_requests, args.seed)  # noqa: E731
    else:
        at = lambda rate: w.from_preset(args.preset or "mixed", rate, args.num_requests, args.seed)  # noqa: E731
    return at, at(1.0)


def _slo(args, model, sample):
    """The plan's SLOs: given in ms, or the multiples of the model's unloaded TTFT (the median
    prompt's prefill plus the colocated serving path) and TPOT (a batch of one at the median
    context plus the serving path's per-token part), as bench serve scales them from measurement."""
    import statistics

    from measure.serve_metrics import SLO
    from measure.serve_slo import SLOScale, record, scaled

    ttft = statistics.median(model.prefill_ms(r.prompt_tokens)
                             + model.colocated.ttft_ms(r.prompt_tokens, r.prompt_tokens, 0.0) for r in sample)
    tpot = statistics.median(model.step_ms(1, r.prompt_tokens + r.output_tokens // 2, 0)
                             + model.colocated.token_ms for r in sample)
    scale = SLOScale(None if args.ttft_slo_ms else args.ttft_slo_scale,
                     None if args.tpot_slo_ms else args.tpot_slo_scale)
    fixed = SLO(ttft_ms=args.ttft_slo_ms or SLO().ttft_ms, tpot_ms=args.tpot_slo_ms or SLO().tpot_ms)
    slo = scaled(scale, fixed, ttft, tpot)
    return slo, record(scale, slo, ttft, tpot, "the profile's model")


def run(args) -> int:
    import json
    import statistics

    from coordinator.config import ClusterConfig
    from measure.serve_trace import is_mooncake
    from planner.des import SimConfig
    from planner.model import from_profile
    from planner.report import format_plan, plot, to_json
    from planner.search import Target, plan

    mooncake = bool(args.trace) and is_mooncake(args.trace)
    if args.validate and ((args.trace and not mooncake) or args.prompt or args.output):
        print("--validate serves one of bench serve's presets (--preset) or a Mooncake trace, not a plan "
              "trace JSON or --prompt/--output")
        return 2
    path = args.profile or profile_path(args.model or "smollm2")
    if path is None:
        m = args.model or "smollm2"
        print(f"no profile for {m}: make one with `{profile_command(m)}` (a few minutes; --quick: about "
              f"one), then run plan again here (it finds profile-*.json here or in out/), or pass "
              f"--profile FILE")
        return 2
    with open(path) as f:
        profile = json.load(f)
    model = from_profile(profile, args.contention)
    served = args.model or (profile.get("config") or {}).get("model") or "smollm2"
    if not args.profile:
        print(f"profile: {path} (model {served})")
    local_max = args.local_prefill_max_tokens
    if local_max is None:
        local_max = ClusterConfig.__dataclass_fields__["local_prefill_max_tokens"].default
    base = SimConfig(step_budget=args.step_budget, block_size=model.block_size, num_blocks=args.num_blocks,
                     local_prefill_max_tokens=local_max, overhead_ms=args.overhead_ms)
    at, sample = _workload(args)
    median_prompt = int(statistics.median(r.prompt_tokens for r in sample))
    slo, scaling = _slo(args, model, sample)
    target = Target(slo, args.attainment)
    result = plan(at, model, args.budget, sorted(args.rates), target, base, median_prompt)
    threshold = {"local_prefill_max_tokens": local_max, "profile_crossover": model.crossover_tokens}
    print(f"SLO: TTFT {slo.ttft_ms:.0f} ms, TPOT {slo.tpot_ms:.1f} ms ({_how(scaling)}), attainment "
          f"{args.attainment:.0%}; "
          f"contention {model.contention:g}; serving path: colocated {model.colocated.describe()}; "
          f"disaggregated {model.disaggregated.describe()}"
          + (f", extra {args.overhead_ms:g} ms" if args.overhead_ms else ""))
    print(format_plan(result, threshold))
    out = to_json(result, threshold, {"profile": path, "model": served, "rates": list(args.rates),
                                      "slo": vars(slo), "slo_scaling": scaling,
                                      "attainment": args.attainment, "contention": model.contention,
                                      "overhead_ms": args.overhead_ms, "median_prompt": median_prompt})
    if args.validate:
        from planner.validate import format_validate, run_validate

        v = run_validate(model, args.rates, args.validate_requests, slo, model.contention or 1.0,
                         log=lambda m: print(m, flush=True), preset=args.preset or "mixed",
                         served_model=served, trace=args.trace if mooncake else None,
                         step_budget=args.step_budget, search_steps=args.validate_search,
                         predicted_goodput={r["config"]: r["sustained_rate"]
                                            for r in result.get(2, {}).get("rows", [])})
        print("\nvalidation (bench serve here, beside the model), ms and req/s")
        print(format_validate(v))
        out["validate"] = v
    for saved in args.resimulate:
        from planner.validate import format_validate, resimulate

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


def _how(rec: dict) -> str:
    parts = []
    for name in ("ttft", "tpot"):
        m = rec[f"{name}_multiple"]
        parts.append(f"{name.upper()} fixed" if m is None else
                     f"{name.upper()} {m:g} x unloaded {rec[f'unloaded_{name}_ms']:.1f} ms")
    return ", ".join(parts)
