"""`pdserve profile`'s contention part: the median decode step of one engine process alone, then of
two stepping at once (child processes of this module speaking JSON lines over pipes, no pickle),
alternated; what the planner's `contention` term takes. Bounded: a watchdog kills the children."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _contention_child() -> int:
    """`python -m planner.profile_contention`: one engine process of the contention measurement. JSON
    lines: the job on stdin, then {"ready"} out; each {"run"} in is answered by the median step ms
    of `steps` decode steps; {"stop"} (or EOF) ends it."""
    import torch

    from engine.engine import EngineConfig, LLMEngine
    from engine.sampling import SamplingParams

    job = json.loads(sys.stdin.readline())
    torch.set_num_threads(1)  # as every worker (runtime.actor)
    engine = LLMEngine(EngineConfig(model=job["model"], block_size=job["block_size"], device="cpu",
                                    num_blocks=512, weights=job["weights"]))
    params = SamplingParams(max_tokens=job["max_tokens"], ignore_eos=True)
    ids = [engine.add_request([1 + (i * 7 + j) % 100 for i in range(job["ctx"])], params)
           for j in range(job["batch"])]
    while any(not engine.requests[i].seqs[0].output_ids for i in ids):
        engine.step()  # every prompt prefilled
    for _ in range(5):
        engine.step()  # warm-up
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if json.loads(line).get("stop"):
            break
        times = []
        for _ in range(job["steps"]):
            t0 = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - t0) * 1e3)
        print(json.dumps({"ms": statistics.median(times)}), flush=True)
    return 0


def _ask(procs, msg: dict) -> list[dict]:
    for p in procs:
        p.stdin.write(json.dumps(msg) + "\n")
        p.stdin.flush()
    return [json.loads(p.stdout.readline() or "null") for p in procs]


def measure_contention(cfg, log=print, batch: int = 8, ctx: int = 128, rounds: int = 3) -> dict:
    """Median decode step (batch x ctx) of one engine process alone, then of two stepping at once,
    alternated `rounds` times (the machine's other load moves: each pair is taken together);
    contention = median of together / alone - 1. JSON lines over pipes, no pickle."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    procs = [subprocess.Popen([sys.executable, "-m", "planner.profile_contention"], cwd=ROOT, env=env,
                              text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in range(2)]
    watchdog = threading.Timer(300.0, lambda: [p.kill() for p in procs])
    watchdog.daemon = True
    watchdog.start()
    try:
        job = {"model": cfg.model, "weights": cfg.weights, "block_size": cfg.block_size, "batch": batch,
               "ctx": ctx, "steps": cfg.contention_steps,
               "max_tokens": 2 * rounds * cfg.contention_steps + 16}
        for p in procs:
            p.stdin.write(json.dumps(job) + "\n")
            p.stdin.flush()
        if not all(json.loads(p.stdout.readline() or "null") for p in procs):
            raise RuntimeError("a contention process did not start")
        pairs = []
        for _ in range(rounds):
            alone = _ask(procs[:1], {"run": True})[0]["ms"]
            pairs.append((alone, statistics.mean(r["ms"] for r in _ask(procs, {"run": True}))))
    finally:
        watchdog.cancel()
        for p in procs:
            with contextlib.suppress(OSError):
                p.stdin.write(json.dumps({"stop": True}) + "\n")
                p.stdin.close()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    alone = statistics.median(a for a, _ in pairs)
    together = statistics.median(t for _, t in pairs)
    factor = max(0.0, statistics.median(t / a for a, t in pairs) - 1.0)
    log(f"  contention: decode step {batch}x{ctx} alone {alone:.2f} ms, two at once {together:.2f} ms "
        f"({rounds} alternations) -> contention {factor:.2f}")
    return {"batch": batch, "context_tokens": ctx, "alone_step_ms": alone, "together_step_ms": together,
            "rounds": [{"alone_ms": a, "together_ms": t} for a, t in pairs], "contention": factor}


if __name__ == "__main__":
    sys.exit(_contention_child())
