"""HTTP helpers shared by the cluster test modules (tests/test_cluster*.py): plain urllib calls to
a coordinator on loopback, a bounded poll for "at rest", and the in-process reference tokens.
Their fixtures (a local Ray, the reference engine) live in conftest.py."""

from __future__ import annotations

import json
import time
import urllib.request

from engine.sampling import SamplingParams


def post(port: int, body: dict, timeout: float = 120.0):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def complete(port: int, body: dict) -> dict:
    with post(port, body) as r:
        return json.loads(r.read())


def stream(port: int, body: dict) -> dict[int, list[int]]:
    """token ids per choice index, from the server-sent events of a streamed completion."""
    out: dict[int, list[int]] = {}
    with post(port, {**body, "stream": True}) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return out
            for c in json.loads(line[6:])["choices"]:
                out.setdefault(c["index"], []).extend(c.get("token_ids") or [])
    raise AssertionError("stream ended without [DONE]")


def stream_killing(port: int, body: dict, kill) -> list[str]:
    """Stream a completion and call kill() on its first data chunk; returns every `data:` payload
    (the stream must still end, with an error chunk, then [DONE])."""
    lines: list[str] = []
    with post(port, {**body, "stream": True}) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: {") and not lines:
                kill()
            if line.startswith("data: "):
                lines.append(line[6:])
    return lines


def get(port: int, path: str) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return r.read()


def cluster_info(port: int) -> dict:
    return json.loads(get(port, "/v1/cluster"))


def wait_at_rest(port: int, deadline_s: float = 20.0) -> dict:
    """/v1/cluster once the ledger has no active request and no live worker holds a used or a
    reserved block (workers report every ~0.2 s); the last snapshot if that never happens."""
    end = time.monotonic() + deadline_s
    while True:
        info = cluster_info(port)
        live = [w for w in info["workers"] if w["alive"]]
        quiet = all(w["used_blocks"] == 0 and w.get("reserved_blocks", 0) == 0 for w in live)
        if (info["ledger"]["active_requests"] == 0 and quiet) or time.monotonic() > end:
            return info
        time.sleep(0.2)


def ledger_differences(info: dict) -> dict[str, tuple[int, int]]:
    """Live workers whose used blocks differ from what the ledger records for them:
    name -> (ledger, worker). Empty when the two agree."""
    owned = info["ledger"]["owned_blocks_by_worker"]
    return {w["name"]: (owned.get(w["name"], 0), w["used_blocks"]) for w in info["workers"]
            if w["alive"] and owned.get(w["name"], 0) != w["used_blocks"]}


def discrepancies(port: int) -> float:
    """pdserve_ledger_discrepancies_total summed over kinds."""
    text = get(port, "/metrics").decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("pdserve_ledger_discrepancies_total{"))


def workers(port: int) -> dict[str, dict]:
    return {w["name"]: w for w in cluster_info(port)["workers"]}


def poll_workers(port: int, ok, deadline_s: float = 20.0) -> dict[str, dict]:
    """Worker stats (from their reports, ~0.2 s apart) once `ok(workers)` holds; the last ones
    if it never does within the deadline (the caller's asserts then fail with them)."""
    end = time.monotonic() + deadline_s
    while True:
        found = workers(port)
        if ok(found) or time.monotonic() > end:
            return found
        time.sleep(0.2)


def set_router(server, role: str, policy: str) -> None:
    from coordinator.router import Router

    async def set_it():
        server.backend.routers[role] = Router(policy)
    server.call(set_it())


def greedy_ids(engine, prompt, **params) -> list[int]:
    ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    return engine.generate([ids], SamplingParams(**params))[0].choices[0]["token_ids"]


def reference(engine, prompts, params: SamplingParams) -> list[list[list[int]]]:
    """The in-process engine's token ids, per prompt, per choice."""
    return [[c["token_ids"] for c in comp.choices] for comp in engine.generate(prompts, params)]
