"""`pdserve bench soak`: a steady request rate against a local cluster for M minutes; samples each
worker's RSS and free blocks over time and fits their slopes (a leak shows as a trend); writes
JSON and a plot."""

from __future__ import annotations

from pdserve_cli import transport_arg

NAME = "soak"
HELP = "hold a steady request rate; plot RSS and free blocks per worker over time, with their slopes"
GROUP = "bench"


def add_arguments(p) -> None:
    p.add_argument("--minutes", type=float, default=20.0, help="run length in minutes (default 20)")
    p.add_argument("--seconds", type=float, help="run length in seconds (overrides --minutes)")
    p.add_argument("--rate", type=float, help="requests per second (default 2)")
    p.add_argument("--sample-s", type=float, help="seconds between samples (default 2)")
    transport_arg.add(p)
    p.add_argument("--seed", type=int, help="seed of prompts and arrivals")
    p.add_argument("--json", metavar="FILE", help="write the report (every sample) as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot RSS and free blocks per worker over time")


def run(args) -> int:
    import json
    import os
    import sys

    from bench.soak import SoakConfig, format_slopes, plot, run_soak

    over = {"seconds": args.seconds if args.seconds else args.minutes * 60.0}
    for key in ("rate", "sample_s", "transport", "seed"):
        if getattr(args, key) is not None:
            over[key] = getattr(args, key)
    try:
        cfg = SoakConfig(**over)
    except ValueError as e:
        print(f"bad arguments: {e}", file=sys.stderr)
        return 2
    report = run_soak(cfg)
    print(f"requests: {report['requests']}; at rest: {report['at_rest']['leaked_blocks']} blocks leaked; "
          f"slopes after the first {report['slope_after_s']:g} s:")
    print(format_slopes(report))
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
        plot(report, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0 if report["at_rest"]["leaked_blocks"] == 0 and report["requests"].get("failed", 0) == 0 else 1
