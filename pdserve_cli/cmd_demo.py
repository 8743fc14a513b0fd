"""`pdserve demo`: the README's main job (`make demo` runs it).

Today it runs the allocator-policy simulator on the shipped scenario (table + figure under
--out), then the paged engine in-process on a handful of requests: two sharing a long prefix
(the second prefills only its suffix), one with n=2 sharing its prompt blocks, one beam
search, with the pool's block accounting before and after.
"""

from __future__ import annotations

import argparse
import os
import time

NAME = "demo"
GROUP = None
HELP = "run the main demo: allocator-policy simulator, then the paged engine on a few requests"


def add_arguments(p) -> None:
    p.add_argument("--out", default="out/demo", help="folder for the JSON and figure (default out/demo)")


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
    print("== 2. The paged engine (tiny model, block size 16, 256 blocks) ==")
    return _engine_demo()


def _engine_demo() -> int:
    from engine.engine import EngineConfig, LLMEngine
    from engine.sampling import SamplingParams

    eng = LLMEngine(EngineConfig(model="tiny", block_size=16, num_blocks=256))
    tok = eng.tokenizer
    prefix = ("System: you are a careful assistant that answers in one short sentence. "
              "Context: paged KV caches split each sequence into fixed-size blocks. ")
    jobs = [
        ("shared prefix A", prefix + "Question: what is a block table?", SamplingParams(max_tokens=16)),
        ("shared prefix B", prefix + "Question: why share blocks?", SamplingParams(max_tokens=16)),
        ("n=2 sampling", "Once upon a time", SamplingParams(max_tokens=12, n=2, temperature=0.8, seed=7)),
        ("beam search k=3", "The capital of", SamplingParams(max_tokens=8, beam_width=3)),
    ]
    for label, text, params in jobs:
        ids = tok.encode(text)
        hits_before = eng.kv.prefix_hit_tokens
        t0 = time.perf_counter()
        [done] = eng.generate([ids], params)
        ms = (time.perf_counter() - t0) * 1e3
        hits = eng.kv.prefix_hit_tokens - hits_before
        print(f"- {label}: prompt {len(ids)} tokens, prefix-cache hit {hits} tokens, {ms:.0f} ms")
        for c in done.choices:
            print(f"    [{c['index']}] {c['finish_reason']:6s} ids {c['token_ids']}")
    u = eng.kv.usage()
    eng.kv.check_integrity()
    print(f"pool at rest: {u['used_blocks']} used, {u['cached_blocks']} cached (prefix cache), "
          f"{u['free_blocks']} free of {u['total_blocks']}; copy-on-write copies {eng.kv.cow_copies}; "
          f"integrity check passed")
    return 0
