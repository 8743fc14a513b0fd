"""`pdserve bench sim`: deterministic simulation of the KV migration protocol and the ownership
ledger (dst): many seeds, each a whole cluster in one process on a virtual clock with faults drawn
from the seed, invariants checked after every step. A failing seed is shrunk to a minimal fault
schedule and printed as the one command that replays it. `--seed S --faults ...` replays one run;
`--mutant NAME` puts a known bug back (dst.mutants) to show it is found; `--exhaustive` enumerates
every delivery order and fault placement of a small case (dst.explore). `--jobs N` runs the seeds in
N processes (dst.parallel); a long run says how far it is every 10,000 seeds. `--transport NAME` (default
zmq) models that transport's declared delivery guarantees (transfer.registry; dst.guarantees): the
network and the faults drawn are what it allows, and the replay line names it. Exit status 1 on a
broken invariant."""

from __future__ import annotations

NAME = "sim"
HELP = "deterministic simulation: seeds of faults against the real migration protocol and ledger"
GROUP = "bench"


def add_arguments(p) -> None:
    p.add_argument("--seeds", type=int, default=10_000, help="seeds to run (default 10000)")
    p.add_argument("--first", type=int, default=0, help="first seed (default 0)")
    p.add_argument("--seed", type=int, help="run this one seed (with --faults: replay that schedule)")
    p.add_argument("--faults", help="the fault schedule to replay, as printed (at:kind:arg,...)")
    p.add_argument("--mutant", help="put this known bug back for the run (see dst.mutants)")
    p.add_argument("--transport", default="zmq",
                   help="model this registered transport's declared guarantees (zmq, ray, nixl, or a "
                        "'module:attr' path; default zmq)")
    p.add_argument("--prefills", type=int, default=1, help="prefill workers (default 1)")
    p.add_argument("--decodes", type=int, default=1, help="decode workers (default 1)")
    p.add_argument("--requests", type=int, help="requests per seed (default: 1-3, drawn)")
    p.add_argument("--all", action="store_true", help="go on after the first failing seed")
    p.add_argument("--no-shrink", action="store_true", help="print failing schedules as they fired")
    p.add_argument("--exhaustive", action="store_true",
                   help="enumerate a small case instead (1 prefill, 1 decode; see --requests, --max-faults)")
    p.add_argument("--max-faults", type=int, default=1, help="exhaustive: faults per run (default 1)")
    p.add_argument("--max-messages", type=int, default=40, help="exhaustive: sends that faults may hit")
    p.add_argument("--kinds", help="exhaustive: fault kinds, comma separated (default: all but delay)")
    p.add_argument("--no-stage", action="store_true", help="exhaustive: the decode worker lands in place")
    p.add_argument("--time-limit", type=float, default=600.0, help="exhaustive: seconds (default 600)")
    p.add_argument("--stream", action="store_true",
                   help="exhaustive: the prefill worker migrates while it computes the prompt")
    p.add_argument("--jobs", type=int, default=1,
                   help="run the seeds in this many processes (contiguous shards; default 1)")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON (with the machine)")


def run(args) -> int:
    import sys

    from dst.faults import format_schedule, parse_schedule
    from dst.guarantees import net_model
    from dst.mutants import mutant
    from dst.run import replay_command, run_seed, run_seeds, shrink
    from dst.workers import SimConfig

    try:
        model = net_model(args.transport)
    except ValueError as e:
        print(f"--transport: {e}")
        return 2
    world = {"cfg": SimConfig(prefills=args.prefills, decodes=args.decodes), "transport": model}
    shape = {k: v for k, v in (("prefills", args.prefills), ("decodes", args.decodes)) if v != 1}
    if args.requests is not None:
        world["requests"] = shape["requests"] = args.requests
    if args.exhaustive:
        from dst.explore import KINDS, explore

        kinds = tuple(args.kinds.split(",")) if args.kinds else KINDS
        report = explore(requests=args.requests or 1, max_faults=args.max_faults, kinds=kinds,
                         transport=model, max_messages=args.max_messages, mutant_name=args.mutant,
                         stage=not args.no_stage, time_limit_s=args.time_limit, stream=args.stream)
        print(f"exhaustive: {report['runs']} runs, {report['states']} distinct states, "
              f"{report['seconds']:.1f} s, {'complete' if report['complete'] else 'NOT complete'}, "
              f"violation: {report['violation'] or 'none'}")
        return _write(args, report, 1 if report["violation"] else 0)
    if args.seed is not None:
        faults = parse_schedule(args.faults) if args.faults is not None else None
        with mutant(args.mutant):
            try:
                out = run_seed(args.seed, faults, **world)
            except ValueError as e:  # a scheduled fault the transport does not allow
                print(e)
                return 2
        print(f"seed {out.seed}: {out.steps} steps, {out.answered} answered, {out.failed} failed, "
              f"faults {format_schedule(out.faults) or 'none'}")
        print(f"violation: {out.violation}" if out.violation else "no invariant broken")
        return 1 if out.violation else 0
    if args.jobs > 1:
        from dst.parallel import run_seeds_in_processes

        report = run_seeds_in_processes(args.first, args.seeds, args.jobs, _passthrough(args))
        failures = report["failures"]
    else:
        def progress(t: dict) -> None:
            print(f"sim from seed {args.first}: {t['seeds']}/{args.seeds} seeds, {t['seconds']:.0f} s, "
                  f"{t['broken']} broken", file=sys.stderr, flush=True)

        report = run_seeds(args.first, args.seeds, mutant_name=args.mutant, stop_at_first=not args.all,
                           progress=progress, **world)
        failures = []
        for out in report["failures"][:5]:
            faults = out.faults if args.no_shrink else shrink(out.seed, out.faults, args.mutant, **world)
            cmd = replay_command(out.seed, faults, args.mutant, transport=model, **shape)
            failures.append({"seed": out.seed, "violation": out.violation, "replay": cmd})
    rate = report["seeds"] / max(report["seconds"], 1e-9)
    where = f" in {args.jobs} processes" if args.jobs > 1 else ""
    print(f"{model.transport}: {report['seeds']} seeds in {report['seconds']:.1f} s "
          f"({rate:.0f} seeds/s{where}): {report['answered']} requests answered, {report['failed']} failed, "
          f"{report['faults']} faults, {len(failures)} broken invariants")
    for failure in failures[:5]:
        print(f"  seed {failure['seed']}: {failure['violation']}\n    replay: {failure['replay']}")
    report = {**report, "failures": failures, "seeds_per_s": rate, "transport": model.transport,
              "fault_kinds": list(model.kinds), "first": args.first, "jobs": args.jobs}
    return _write(args, report, 1 if failures else 0)


def _passthrough(args) -> list[str]:
    """The options a shard process runs with (all but the range, the jobs and the JSON)."""
    out = ["--transport", args.transport, "--prefills", str(args.prefills), "--decodes", str(args.decodes)]
    if args.requests is not None:
        out += ["--requests", str(args.requests)]
    if args.mutant:
        out += ["--mutant", args.mutant]
    return out + [flag for flag, on in (("--all", args.all), ("--no-shrink", args.no_shrink)) if on]


def _write(args, report: dict, status: int) -> int:
    import json
    import os
    import sys

    if args.json:
        from measure.machine import describe

        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({**report, "machine": describe(bandwidth=False)}, f, indent=1, default=str)
        print(f"wrote {args.json}", file=sys.stderr)
    return status
