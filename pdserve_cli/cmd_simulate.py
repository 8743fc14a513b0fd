"""`pdserve simulate`: run the allocator-policy simulator on a scenario (the shipped one by default),
print one table row per policy, and optionally write the JSON results and the cache-layout figure.
The simulator and its report live in `allocsim`.
"""

from __future__ import annotations

import sys

NAME = "simulate"
HELP = ("run max-reservation, exact-contiguous and paged KV allocation on one request trace and "
        "compare rejections, growth failures and waste")
GROUP = None


def add_arguments(parser) -> None:
    parser.add_argument("--scenario", metavar="FILE",
                        help="scenario JSON (default: the shipped deploy/scenarios/seed.json)")
    parser.add_argument("--json", metavar="FILE", help="write the per-policy results and series as JSON")
    parser.add_argument("--figure", metavar="FILE", help="draw the cache over time (.svg or .png)")


def run(args) -> int:
    from allocsim.figure import FORMATS
    from allocsim.report import load, run_and_report, source_name
    from allocsim.scenario import ScenarioError

    if args.figure and not args.figure.lower().endswith(FORMATS):
        print(f"pdserve simulate: --figure {args.figure}: extension must be one of {', '.join(FORMATS)}",
              file=sys.stderr)
        return 2
    source = source_name(args.scenario)
    try:
        scenario = load(args.scenario)
    except (OSError, ScenarioError) as e:
        print(f"pdserve simulate: {source}: {e}", file=sys.stderr)
        return 2
    run_and_report(scenario, source, args.json, args.figure)
    return 0
