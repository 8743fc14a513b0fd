"""`pdserve simulate`: run the allocator-policy simulator on a scenario (the shipped one by default),
print one table row per policy, and optionally write the JSON results and the cache-layout figure.
"""

from __future__ import annotations

import json
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
    from kvcache.sim import scenario as sc
    from kvcache.sim.figure import FORMATS, draw_figure
    from kvcache.sim.run import format_table, results_to_json, simulate

    if args.figure and not args.figure.lower().endswith(FORMATS):
        print(f"pdserve simulate: --figure {args.figure}: extension must be one of {', '.join(FORMATS)}",
              file=sys.stderr)
        return 2
    source = args.scenario or str(sc.default_scenario_path())
    try:
        scenario = sc.load_scenario(args.scenario) if args.scenario else sc.load_default_scenario()
    except (OSError, sc.ScenarioError) as e:
        print(f"pdserve simulate: {source}: {e}", file=sys.stderr)
        return 2
    results = simulate(scenario, record_layout=bool(args.figure))
    print(f"scenario {source}: capacity {scenario.capacity} slots, {len(scenario.requests)} requests, "
          f"block sizes {list(scenario.block_sizes)}")
    print(format_table(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results_to_json(results), f, indent=1)
        print(f"wrote {args.json}")
    if args.figure:
        draw_figure(results, scenario, args.figure)
        print(f"wrote {args.figure}")
    return 0
