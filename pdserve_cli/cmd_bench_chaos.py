"""`pdserve bench chaos`: faults (worker SIGKILLs, client disconnects, dropped / duplicated /
delayed / reordered / bit-flipped KV transfers, forged events and imports) injected into a local
cluster under steady load; every answer checked against the local engine; per fault: correct,
failed clean, wrong, leaked blocks, corruptions injected vs detected, false positives, recovery
time. Writes JSON and a plot; exits 1 unless no answer was wrong, no block leaked, every
corruption was detected and none was a false positive."""

from __future__ import annotations

from pdserve_cli import transport_arg

NAME = "chaos"
HELP = "fault injection under load: wrong answers, leaked blocks, detected corruptions, recovery"
GROUP = "bench"


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="20 requests per fault, 320 in all (a few minutes)")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot outcomes and recovery time per fault")
    p.add_argument("--faults", help="comma-separated fault names (default: all, in order)")
    p.add_argument("--requests-per-fault", type=int, help="load requests per fault (default 64; quick 20)")
    p.add_argument("--concurrency", type=int, help="client threads (default 6)")
    p.add_argument("--fault-count", type=int, help="faulted transfers per phase (default 6; quick 3)")
    transport_arg.add(p)
    p.add_argument("--seed", type=int, help="base seed of prompts and sampling seeds")


def run(args) -> int:
    import json
    import os
    import sys
    from dataclasses import replace

    from bench.chaos import QUICK, ChaosConfig, passed, run_chaos
    from bench.chaos_report import format_table, plot

    cfg = QUICK if args.quick else ChaosConfig()
    over: dict = {}
    if args.faults:
        over["faults"] = tuple(f.strip() for f in args.faults.split(",") if f.strip())
    for key in ("requests_per_fault", "concurrency", "fault_count", "transport", "seed"):
        if getattr(args, key) is not None:
            over[key] = getattr(args, key)
    try:
        cfg = replace(cfg, **over)
    except ValueError as e:
        print(f"bad arguments: {e}", file=sys.stderr)
        return 2
    report = run_chaos(cfg)
    print(format_table(report))
    def write_json(path: str) -> None:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)

    for path, write in ((args.json, write_json), (args.plot, lambda p: plot(report, p))):
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            write(path)
            print(f"wrote {path}", file=sys.stderr)
    ok = passed(report)
    print("chaos: " + ("PASS" if ok else "FAIL") + " (0 wrong, 0 leaked, every corruption detected, "
          "0 false positives)", file=sys.stderr)
    return 0 if ok else 1
