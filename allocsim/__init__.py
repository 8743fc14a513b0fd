"""Allocator-policy simulator (the second seed, "The KV Cache Is an Allocator Problem"): one
deterministic request trace run through maximum reservation, exact contiguous growth and paged
allocation with several block sizes, the paged policy using the workers' own `BlockAllocator`.
`scenario` loads and validates the trace, `policies` holds the three policies, `run` is the step
loop and its metrics, and `figure` draws the cache over time; `pdserve simulate` is the command.
"""

from allocsim.run import PolicyResult, StepStats, results_to_json, run_policy, simulate
from allocsim.scenario import Request, Scenario, ScenarioError, load_scenario, parse_scenario

__all__ = ["PolicyResult", "StepStats", "results_to_json", "run_policy", "simulate", "Request", "Scenario",
           "ScenarioError", "load_scenario", "parse_scenario"]
