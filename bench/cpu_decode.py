"""CPU decode attention, the three torch-backend paths side by side, behind `pdserve bench decode`.

Paths: `kernel` (the compiled C kernel reading the paged pool in place, engine.cpu_attention),
`mirror` (the persistent per-slot K/V buffer, engine.attn_mirror) and `gather` (each step gathers
every sequence's blocks, grouped by length, engine.attn_torch). Each case is a model shape, a
batch and a range of context lengths. A pool laid out as the engine's (block-major over every
layer, blocks shuffled) holds random K/V; each path runs the same decode steps, every sequence
one token longer per step, through `attn_torch.forward` on every layer, so a step stores the new
K/V and attends as the engine does, with the other layers' data passing through the caches in
between. Paths take turns in blocks of steps (the mirror needs consecutive steps to keep its
entries), three rounds; the report gives each path's median time per layer and step, the ratios,
and the K/V bytes the step attends divided by the kernel's time. One torch thread. JSON and a
bar chart.
"""

from __future__ import annotations

import json
import random
import statistics
import time

import torch

# (name, q heads, kv heads, head dim, layers timed, sequences, shortest and longest context)
CASES = [("tiny, short preset", 4, 2, 32, 4, 32, 16, 128),
         ("tiny, long preset", 4, 2, 32, 4, 32, 480, 512),
         ("SmolLM2, 8 sequences", 9, 3, 64, 6, 8, 480, 512),
         ("SmolLM2, 32 sequences", 9, 3, 64, 6, 32, 480, 512)]
PATHS = ("kernel", "mirror", "gather")
BLOCK = 16


def _workspace(path: str):
    from engine.attn_torch import Workspace

    return Workspace(mirror=path == "mirror", kernel=path == "kernel")


def run_case(case: tuple, steps: int, rounds: int, seed: int = 0) -> dict:
    """Median seconds per layer-step of each path for one case."""
    from engine import attn_torch
    from engine.attn_metadata import AttentionMetadata
    from kvcache.storage import KVLayout, KVStorage

    name, Hq, Hkv, D, layers, n, low, high = case
    rng = random.Random(seed)
    lens = [rng.randint(low, high) for _ in range(n)]
    final = high + steps * rounds * len(PATHS) + 1
    per_seq = -(-final // BLOCK)
    storage = KVStorage(KVLayout(layers, Hkv, D, BLOCK), n * per_seq, null_block=True)
    storage.data.normal_()
    ids = list(range(n * per_seq))
    rng.shuffle(ids)
    tables = [ids[i * per_seq:(i + 1) * per_seq] for i in range(n)]
    views = [storage.layer_view(i) for i in range(layers)]
    gen = torch.Generator().manual_seed(seed)
    spaces = {path: _workspace(path) for path in PATHS}
    times: dict[str, list[float]] = {path: [] for path in PATHS}
    attended: list[int] = []
    for _ in range(rounds):
        for path in PATHS:
            for _ in range(steps):
                lens = [x + 1 for x in lens]
                meta = AttentionMetadata.build([t[:-(-x // BLOCK)] for t, x in zip(tables, lens)], lens,
                                               [1] * n, BLOCK, null_block=storage.null_block_id)
                meta.workspace, meta.seq_ids, meta.final_lens = spaces[path], list(range(n)), [final] * n
                q, key, value = (torch.randn(n, h, D, generator=gen) for h in (Hq, Hkv, Hkv))
                t0 = time.perf_counter()
                for layer, (k_cache, v_cache) in enumerate(views):
                    attn_torch.forward(q, key, value, k_cache, v_cache, meta, D ** -0.5, layer)
                times[path].append((time.perf_counter() - t0) / layers)
                attended.append(sum(lens))
    med = {path: statistics.median(ts) for path, ts in times.items()}
    kv_bytes = statistics.median(attended) * Hkv * D * 4 * 2  # keys and values attended per layer-step
    return {"case": name, "q_heads": Hq, "kv_heads": Hkv, "head_dim": D, "sequences": n,
            "context": [low, high], "layers": layers, "steps_per_path": steps * rounds,
            "us_per_layer_step": {p: m * 1e6 for p, m in med.items()},
            "kernel_speedup_vs_mirror": med["mirror"] / med["kernel"],
            "kernel_speedup_vs_gather": med["gather"] / med["kernel"],
            "kernel_kv_gbytes_per_s": kv_bytes / med["kernel"] / 1e9}


def _plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.27
    for i, p in enumerate(PATHS):
        xs = [j + (i - 1) * width for j in range(len(results))]
        ax.bar(xs, [r["us_per_layer_step"][p] for r in results], width, label=p)
    ax.set_xticks(range(len(results)), [r["case"] for r in results], fontsize=8)
    ax.set_ylabel("microseconds per layer and step (median)")
    ax.set_title("CPU decode attention: kernel (pool in place) vs mirror vs gather")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(json_path: str | None = None, steps: int = 16, rounds: int = 3) -> dict:
    from engine import cpu_attention

    if not cpu_attention.available():
        raise SystemExit("the CPU decode kernel is not available (no C compiler?): nothing to compare")
    from measure.machine import describe, summary

    torch.set_num_threads(1)
    where = describe()
    print(summary(where), flush=True)
    results = []
    for i, case in enumerate(CASES):
        print(f"[{i + 1}/{len(CASES)}] {case[0]}: {case[5]} sequences, contexts {case[6]}..{case[7]}",
              flush=True)
        r = run_case(case, steps, rounds)
        results.append(r)
        times = ", ".join(f"{p} {r['us_per_layer_step'][p]:.0f} us" for p in PATHS)
        print(f"    {times}; kernel {r['kernel_speedup_vs_mirror']:.2f}x the mirror, "
              f"{r['kernel_speedup_vs_gather']:.2f}x the gather, "
              f"{r['kernel_kv_gbytes_per_s']:.1f} GB/s of K/V", flush=True)
    report = {"machine": where,
              "config": {"steps_per_block": steps, "rounds": rounds, "block_size": BLOCK, "torch_threads": 1},
              "cases": results}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
        _plot(results, json_path.rsplit(".", 1)[0] + ".png")
        print(f"wrote {json_path} and its .png")
    return report
