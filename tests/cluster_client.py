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


def reference(engine, prompts, params: SamplingParams) -> list[list[list[int]]]:
    """The in-process engine's token ids, per prompt, per choice."""
    return [[c["token_ids"] for c in comp.choices] for comp in engine.generate(prompts, params)]
