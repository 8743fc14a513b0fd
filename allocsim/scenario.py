"""Scenario files for the allocator-policy simulator: load, validate, and hold them as frozen data.

A scenario is JSON: `{"capacity": 80, "block_sizes": [4, 8, 16], "requests": [{"id": "a",
"arrival": 0, "prompt": 10, "max_new_tokens": 14, "output": 6}, ...], "description": "..."}`.
`capacity` counts token slots; `output` (1..max_new_tokens) is how many tokens the request will
generate; `description` is optional free text. Anything malformed raises `ScenarioError` (a
ValueError) whose message starts with the offending field, e.g. `requests[2].output: ...`.
Unknown keys are rejected too, so a typo cannot silently drop a field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

MAX_STEP = 1_000_000  # bound on arrival and max_new_tokens, so every run ends in reasonable time
_TOP_KEYS = {"capacity", "block_sizes", "requests", "description"}
_REQUEST_KEYS = ("id", "arrival", "prompt", "max_new_tokens", "output")


class ScenarioError(ValueError):
    """A malformed scenario; the message names the offending field."""


@dataclass(frozen=True)
class Request:
    """One request of the trace.

    id: unique name (used for colours and messages).
    arrival: step at which the request asks for its initial allocation.
    prompt: prompt tokens, all allocated on admission.
    max_new_tokens: the generation limit it declares (what max reservation reserves for).
    output: tokens it will actually generate (1..max_new_tokens), one per step.
    """

    id: str
    arrival: int
    prompt: int
    max_new_tokens: int
    output: int


@dataclass(frozen=True)
class Scenario:
    """A deterministic trace and the cache it runs in.

    capacity: token slots in the cache (paged_B gets capacity // B blocks).
    block_sizes: the B of each paged policy, in the order they are reported.
    requests: the trace, in file order (which breaks ties between equal arrivals).
    description: free text explaining the trace.
    """

    capacity: int
    block_sizes: tuple[int, ...]
    requests: tuple[Request, ...]
    description: str = ""


def _int(value, field: str, lo: int, hi: int | None = None, what: str | None = None) -> int:
    """An int in lo..hi (bools are not ints here), or ScenarioError naming `field`."""
    rng = what or (f"{lo}..{hi}" if hi is not None else f">= {lo}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScenarioError(f"{field}: must be an integer {rng}, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        raise ScenarioError(f"{field}: must be {rng}, got {value}")
    return value


def _request(raw, i: int) -> Request:
    where = f"requests[{i}]"
    if not isinstance(raw, dict):
        raise ScenarioError(f"{where}: must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_REQUEST_KEYS))
    if unknown:
        raise ScenarioError(f"{where}.{unknown[0]}: unknown field (expected {', '.join(_REQUEST_KEYS)})")
    for key in _REQUEST_KEYS:
        if key not in raw:
            raise ScenarioError(f"{where}.{key}: missing")
    rid = raw["id"]
    if not isinstance(rid, str) or not rid:
        raise ScenarioError(f"{where}.id: must be a non-empty string, got {rid!r}")
    arrival = _int(raw["arrival"], f"{where}.arrival", 0, MAX_STEP)
    prompt = _int(raw["prompt"], f"{where}.prompt", 1, MAX_STEP)
    max_new = _int(raw["max_new_tokens"], f"{where}.max_new_tokens", 1, MAX_STEP)
    output = _int(raw["output"], f"{where}.output", 1, max_new, what="1..max_new_tokens")
    return Request(rid, arrival, prompt, max_new, output)


def parse_scenario(raw) -> Scenario:
    """Validate a decoded JSON value and build the Scenario."""
    if not isinstance(raw, dict):
        raise ScenarioError(f"scenario: must be a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _TOP_KEYS)
    if unknown:
        raise ScenarioError(f"{unknown[0]}: unknown field (expected {', '.join(sorted(_TOP_KEYS))})")
    for key in ("capacity", "block_sizes", "requests"):
        if key not in raw:
            raise ScenarioError(f"{key}: missing")
    capacity = _int(raw["capacity"], "capacity", 1)
    sizes = raw["block_sizes"]
    if not isinstance(sizes, list) or not sizes:
        raise ScenarioError(f"block_sizes: must be a non-empty list of integers, got {sizes!r}")
    for i, b in enumerate(sizes):
        _int(b, f"block_sizes[{i}]", 1, capacity, what=f"1..capacity ({capacity})")
        if b in sizes[:i]:
            raise ScenarioError(f"block_sizes[{i}]: duplicate block size {b}")
    reqs = raw["requests"]
    if not isinstance(reqs, list) or not reqs:
        raise ScenarioError("requests: must be a non-empty list of request objects")
    requests = tuple(_request(r, i) for i, r in enumerate(reqs))
    seen: set[str] = set()
    for i, r in enumerate(requests):
        if r.id in seen:
            raise ScenarioError(f"requests[{i}].id: duplicate id {r.id!r}")
        seen.add(r.id)
    description = raw.get("description", "")
    if not isinstance(description, str):
        raise ScenarioError("description: must be a string")
    return Scenario(capacity, tuple(sizes), requests, description)


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file. OSError if unreadable, ScenarioError if malformed."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        where = f"line {e.lineno} column {e.colno}"
        raise ScenarioError(f"scenario: not valid JSON ({e.msg} at {where})") from None
    return parse_scenario(raw)


def default_scenario_path():
    """The shipped scenario (deploy/scenarios/seed.json) as an importlib.resources Traversable."""
    return resources.files("deploy").joinpath("scenarios").joinpath("seed.json")


def load_default_scenario() -> Scenario:
    """The shipped scenario that reproduces the seed's findings."""
    raw = default_scenario_path().read_text(encoding="utf-8")
    return parse_scenario(json.loads(raw))
