"""The demo `pdserve demo` (and `make demo`) runs, for a newcomer: first what pdserve is, a
disaggregated cluster on an embedded local Ray with 1 prefill + 1 decode worker serving a real
model (SmolLM2-135M-Instruct by default, `smollm2`; `tiny` is the random test model, and the demo
says its text is noise) and KV migrated over ZeroMQ (or Ray), to which it sends a handful of
requests over HTTP (two sharing a long prefix, a long prompt whose KV streams out while it is
still being prefilled, one with n=2, one streamed chat), printing each answer's text with its
migration (blocks, bytes, ms, transport; for the long prompt, how much of the transfer overlapped
the prefill) and TTFT/TPOT, then the ownership ledger's end state (nothing owned), before
shutting everything down, the Ray it started included. Then, with one sentence on why it is
there (WHY_ALLOCATOR), the allocator-policy simulator on the shipped trace (table, JSON and figure
under `out`). Only the command line imports this module.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request

DEFAULT_MODEL = "smollm2"
RANDOM_MODEL = "tiny"  # weights drawn from a seed (engine.loader): its answers are byte noise
RANDOM_NOTE = ("tiny is a random model: its text is noise (the migrations, timings and ledger are real; "
               "--model smollm2 answers in English)")
WHY_ALLOCATOR = ("Why paged blocks: the cluster above keeps every prompt's KV in fixed-size blocks, and this "
                 "replays a shipped request trace through the other ways to hand out that memory "
                 "(fail_w/_free: requests refused or cut off although enough of it was free, in pieces).")


def run(out: str = "out/demo", transport: str = "zmq", block_size: int = 16,
        decode_block_size: int = 0, model: str = DEFAULT_MODEL, weights: str = "f32") -> int:
    """Both steps, the cluster first; 0 on success, the cluster's failure status, or 2 when the
    shipped scenario cannot be read."""
    os.makedirs(out, exist_ok=True)
    print(f"== 1. Disaggregated cluster: 1 prefill + 1 decode worker, model {model}, "
          f"{transport} transport, {weights} weights ==")
    if model == RANDOM_MODEL:
        print(RANDOM_NOTE)
    code = _cluster_demo(transport, block_size, decode_block_size, model, weights)
    if code:
        return code
    print()
    print("== 2. Allocator policies on a shipped trace ==")
    print(WHY_ALLOCATOR)
    return _allocator_study(out)


def _allocator_study(out: str) -> int:
    from allocsim.report import load, run_and_report, source_name
    from allocsim.scenario import ScenarioError

    source = source_name(None)
    try:
        scenario = load(None)
    except (OSError, ScenarioError) as e:
        print(f"pdserve demo: {source}: {e}", file=sys.stderr)
        return 2
    run_and_report(scenario, source, os.path.join(out, "simulate.json"), os.path.join(out, "simulate.png"))
    return 0


def _post(base: str, body: dict, path: str = "/v1/completions") -> dict:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _stream(base: str, body: dict, path: str = "/v1/completions") -> dict:
    """Read the server-sent events; returns the last chunk with the streamed text and ids joined
    (a chat chunk's text is its `delta.content`)."""
    req = urllib.request.Request(base + path, data=json.dumps({**body, "stream": True}).encode(),
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
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
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
        text = c["text"] if "text" in c else c["message"]["content"]
        print(f"    [{c['index']}] {c['finish_reason']:6s} {len(c['token_ids'])} tokens: {printable(text)}")


def _overlap(body: dict) -> None:
    """How much of a streamed migration overlapped the prompt's prefill."""
    phases = ((body.get("pdserve", {}).get("backend") or {}).get("migration") or {}).get("phases") or {}
    if "overlap_pct" in phases:
        print(f"    streamed migration: {phases['overlap_pct']:.0f}% of the KV left while the prompt was "
              f"still computing ({phases['streamed_ms']:.0f} ms alongside the prefill); "
              f"{phases['exposed_ms']:.1f} ms after its last chunk")
    else:
        print("    migrated whole after the prefill (no streamed migration)")


def printable(text: str) -> str:
    """The answer on one line: whitespace runs (newlines too) become one space."""
    return " ".join(text.split()) or "(empty)"


def _cluster_demo(transport: str, block_size: int, decode_block_size: int, model: str,
                  weights: str = "f32") -> int:
    from coordinator.cluster import ClusterConfig
    from deploy.launch import ClusterServer, RayConfig, start_ray, stop_ray

    t0 = time.perf_counter()
    started = start_ray(RayConfig())
    # a step budget of 128 tokens: the long prompt below prefills in chunks, and its KV streams out
    srv = ClusterServer(ClusterConfig(prefill=1, decode=1, transport=transport, model=model,
                                      block_size=block_size, decode_block_size=decode_block_size,
                                      engine={"scheduler": {"max_num_batched_tokens": 128},
                                              "weights": weights}))
    try:
        port = srv.start()
        base = f"http://127.0.0.1:{port}"
        how = "started" if started else "joined"
        print(f"cluster up at {base} in {time.perf_counter() - t0:.1f} s (Ray {how})")
        prefix = ("The following are short, factual answers to questions about geography. "
                  "Each answer is one sentence.\n\n")
        common = {"model": model, "temperature": 0.0, "max_tokens": 20}
        line = {**common, "stop": ["\n"]}
        for label, question in (("shared prefix A", "What is the capital of France?"),
                                ("shared prefix B", "What is the longest river in Africa?")):
            _report(label, _post(base, {**line, "prompt": f"{prefix}Q: {question}\nA:"}))
        _report("n=2, seed 7", _post(base, {**common, "prompt": "Once upon a time", "n": 2,
                                            "temperature": 0.8, "seed": 7}))
        long = _post(base, {**line, "prompt": prefix * 8 + "Q: What is the capital of Japan?\nA:"})
        _report("long prompt", long)
        _overlap(long)
        if model == RANDOM_MODEL:  # the random test model has no chat template
            _report("streamed", _stream(base, {**common, "prompt": "Streaming tokens back, one at a time"}))
        else:
            chat = {**common, "max_tokens": 32,
                    "messages": [{"role": "user", "content": "What is the capital of France?"}]}
            _report("chat, streamed", _stream(base, chat, "/v1/chat/completions"))
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
