"""What `pdserve simulate` and the first step of `pdserve demo` show for one scenario: load it (the
shipped `deploy/scenarios/seed.json` unless a file is named), run every policy on it, print a
header line and one table row per policy, and write the JSON results and the cache-over-time
figure when asked. Loading raises `OSError` or `ScenarioError`; the command reports those, so
this module never prints errors or exits.
"""

from __future__ import annotations

import json

from allocsim.figure import draw_figure
from allocsim.run import PolicyResult, format_table, results_to_json, simulate
from allocsim.scenario import Scenario, default_scenario_path, load_default_scenario, load_scenario


def source_name(path: str | None) -> str:
    """How the scenario at `path` (None: the shipped one) is named in messages."""
    return path or str(default_scenario_path())


def load(path: str | None) -> Scenario:
    """The scenario file at `path`, or the shipped one when None."""
    return load_scenario(path) if path else load_default_scenario()


def run_and_report(scenario: Scenario, source: str, json_path: str | None = None,
                   figure_path: str | None = None, log=print) -> list[PolicyResult]:
    """Simulate every policy; log the header and the table; write the JSON and the figure (.svg or
    .png) when their paths are given, logging each file written. Returns the results."""
    results = simulate(scenario, record_layout=bool(figure_path))
    log(f"scenario {source}: capacity {scenario.capacity} slots, {len(scenario.requests)} requests, "
        f"block sizes {list(scenario.block_sizes)}")
    log(format_table(results))
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(results_to_json(results), f, indent=1)
        log(f"wrote {json_path}")
    if figure_path:
        draw_figure(results, scenario, figure_path)
        log(f"wrote {figure_path}")
    return results
