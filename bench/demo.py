"""The demo `pdserve demo` (and `make demo`) runs: first the allocator-policy simulator on the
shipped trace (table, JSON and figure under `out`), then a disaggregated cluster on an embedded
local Ray with 1 prefill + 1 decode worker and KV migrated over ZeroMQ (or Ray), to which it sends
a handful of requests over HTTP (two sharing a long prefix, one with n=2, one streamed), printing
each completion with its migration (blocks, bytes, ms, transport) and TTFT/TPOT, then the
ownership ledger's end state (nothing owned), before shutting everything down, the Ray it started
included. Only the command line imports this module.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request


def run(out: str = "out/demo", transport: str = "zmq", block_size: int = 16,
        decode_block_size: int = 0) -> int:
    """Both steps; 0 on success, 2 when the shipped scenario cannot be read."""
    from bench.sim.report import load, run_and_report, source_name
    from bench.sim.scenario import ScenarioError

    os.makedirs(out, exist_ok=True)
    print("== 1. Allocator policies on the shipped trace (the second seed's experiment) ==")
    source = source_name(None)
    try:
        scenario = load(None)
    except (OSError, ScenarioError) as e:
        print(f"pdserve demo: {source}: {e}", file=sys.stderr)
        return 2
    run_and_report(scenario, source, os.path.join(out, "simulate.json"), os.path.join(out, "simulate.png"))
    print()
    print(f"== 2. Disaggregated cluster: 1 prefill + 1 decode worker, {transport} transport ==")
    return _cluster_demo(transport, block_size, decode_block_size)


def _post(base: str, body: dict) -> dict:
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _stream(base: str, body: dict) -> dict:
    """Read the server-sent events; returns the last chunk with the streamed text and ids joined."""
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    text, ids, last, chunks = "", [], {}, 0
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            last = json.loads(line[6:])
            chunks += 1
            for c in last.get("choices", []):
                text += c.get("text", "")
                ids += c.get("token_ids") or []
    last["choices"] = [{"index": 0, "text": text, "token_ids": ids,
                        "finish_reason": last["choices"][0]["finish_reason"]}]
    last["chunks"] = chunks
    return last


def _report(label: str, body: dict) -> None:
    t = body.get("pdserve", {})
    mig = (t.get("backend") or {}).get("migration") or {}
    mig_s = (f"migrated {mig.get('blocks', 0)} blocks ({mig.get('reused', 0)} reused), "
             f"{mig.get('bytes', 0) / 1024:.0f} KiB in {mig.get('ms', 0):.1f} ms over {mig.get('transport')}"
             if mig else "no migration (finished on the prefill worker)")
    extra = f", {body['chunks']} SSE chunks" if "chunks" in body else ""
    print(f"- {label}: prompt {body['usage']['prompt_tokens']} tokens; {mig_s}; "
          f"TTFT {t.get('ttft_ms', 0):.0f} ms, TPOT {t.get('tpot_ms') or 0:.1f} ms{extra}")
    for c in body["choices"]:
        ids = c["token_ids"]
        print(f"    [{c['index']}] {c['finish_reason']:6s} {len(ids)} tokens: {ids[:12]}...")


def _cluster_demo(transport: str, block_size: int, decode_block_size: int) -> int:
    from coordinator.cluster import ClusterConfig
    from deploy.launch import ClusterServer, RayConfig, start_ray, stop_ray

    t0 = time.perf_counter()
    started = start_ray(RayConfig())
    srv = ClusterServer(ClusterConfig(prefill=1, decode=1, transport=transport, model="tiny",
                                      block_size=block_size, decode_block_size=decode_block_size))
    try:
        port = srv.start()
        base = f"http://127.0.0.1:{port}"
        how = "started" if started else "joined"
        print(f"cluster up at {base} in {time.perf_counter() - t0:.1f} s (Ray {how})")
        prefix = ("System: you are a careful assistant that answers in one short sentence. "
                  "Context: paged KV caches split each sequence into fixed-size blocks. ")
        common = {"model": "tiny", "temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
        _report("shared prefix A", _post(base, {**common, "prompt": prefix + "Q: what is a block table?"}))
        _report("shared prefix B", _post(base, {**common, "prompt": prefix + "Q: why share blocks?"}))
        _report("n=2, seed 7", _post(base, {**common, "prompt": "Once upon a time", "n": 2,
                                            "temperature": 0.8, "seed": 7}))
        _report("streamed", _stream(base, {**common, "prompt": "Streaming tokens back, one step at a time"}))
        with urllib.request.urlopen(base + "/v1/cluster", timeout=30) as r:
            cluster = json.loads(r.read())
        led = cluster["ledger"]
        print(f"ledger at rest: {led['active_requests']} active requests, {led['owned_blocks']} owned "
              f"blocks, {led['finished']} finished, {led['failed']} failed")
        for w in cluster["workers"]:
            print(f"  {w.get('name')}: {w.get('role')}, block size {w.get('block_size')}, "
                  f"{w.get('used_blocks')} used / {w.get('cached_blocks')} cached / "
                  f"{w.get('free_blocks')} free")
    finally:
        srv.stop()
        stop_ray(started)
    print(f"shut down; demo took {time.perf_counter() - t0:.1f} s")
    return 0
