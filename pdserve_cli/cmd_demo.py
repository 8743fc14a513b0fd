"""`pdserve demo`: the README's main job (`make demo` runs it).

1. The allocator-policy simulator on the shipped trace (table, JSON and figure under --out).
2. A disaggregated cluster on an embedded local Ray: 1 prefill + 1 decode worker, KV migrated
   over ZeroMQ (or Ray with --transport ray). It sends a handful of requests over HTTP (two
   sharing a long prefix, one with n=2, one streamed), prints each completion with its
   migration (blocks, bytes, ms, transport) and TTFT/TPOT, then the ownership ledger's end state
   (nothing owned), and shuts everything down, the Ray it started included.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request

NAME = "demo"
GROUP = None
HELP = "run the main demo: allocator-policy simulator, then a 1 prefill + 1 decode cluster on local Ray"


def add_arguments(p) -> None:
    p.add_argument("--out", default="out/demo", help="folder for the JSON and figure (default out/demo)")
    p.add_argument("--transport", choices=("zmq", "ray"), default="zmq", help="KV migration transport")
    p.add_argument("--block-size", type=int, default=16, help="prefill worker's KV block size")
    p.add_argument("--decode-block-size", type=int, default=0,
                   help="decode worker's KV block size (0: same; a different one is re-blocked)")


def run(args) -> int:
    from pdserve_cli import cmd_simulate

    os.makedirs(args.out, exist_ok=True)
    print("== 1. Allocator policies on the shipped trace (the second seed's experiment) ==")
    sim = argparse.Namespace(scenario=None, json=os.path.join(args.out, "simulate.json"),
                             figure=os.path.join(args.out, "simulate.png"))
    code = cmd_simulate.run(sim)
    if code:
        return code
    print()
    print(f"== 2. Disaggregated cluster: 1 prefill + 1 decode worker, {args.transport} transport ==")
    return _cluster_demo(args)


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


def _cluster_demo(args) -> int:
    from coordinator.cluster import ClusterConfig
    from deploy.launch import ClusterServer, RayConfig, start_ray, stop_ray

    t0 = time.perf_counter()
    started = start_ray(RayConfig())
    srv = ClusterServer(ClusterConfig(prefill=1, decode=1, transport=args.transport, model="tiny",
                                      block_size=args.block_size, decode_block_size=args.decode_block_size))
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
