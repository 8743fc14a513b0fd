"""Where a GGUF decode step's time goes, kernel by itself: `python -m bench.gguf_kernel [--threads T]
[--json F]`. One single-row pass over SmolLM2-135M's decoder matrices (30 layers of q, k, v, o,
gate, up, down as Q4_1 blocks of random bytes with sane scales, 66 MB, packed as the engine packs
them and laid out one after another as the arena holds them) through engine.cpu_gguf.GgufLinear,
against a plain read of the same bytes (torch sum, the same threads), and the same kernel on one
1536 x 576 matrix called again and again (553 KB: it stays in L2), per 32-weight block of one
row. If the pass over DRAM runs at the L2 rate, the kernel's arithmetic sets the pace, not the
memory; if it runs well under it, the loads do. Alternating repeats, medians; JSON records where
it ran (measure.machine)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30


def _blocks(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """(n, k / 32 * 20) uint8 Q4_1 rows: random nibbles, d and m small finite halves."""
    w = torch.randint(0, 256, (n, k // 32, 20), dtype=torch.uint8, generator=gen)
    w[..., 0:2] = torch.tensor([0x00, 0x20], dtype=torch.uint8)  # d = 2^-7 (f16 0x2000, little-endian)
    w[..., 2:4] = torch.tensor([0x00, 0xA4], dtype=torch.uint8)  # m = -2^-6
    return w.reshape(n, -1)


def run(threads: int = 1, repeats: int = 9, json_path: str | None = None) -> dict:
    from engine.cpu_gguf import GgufLinear
    from measure import machine

    torch.set_num_threads(threads)
    where = machine.describe()
    print(machine.summary(where), flush=True)
    gen = torch.Generator().manual_seed(0)
    lins = [GgufLinear(_blocks(n, k, gen), "Q4_1", None) for n, k in SHAPES]  # packed, as the engine's
    arena = torch.cat([lin.weight.reshape(-1) for lin in lins])  # one allocation, matrices back to back
    at = 0
    for lin in lins:
        shape = lin.weight.shape
        lin.weight = arena[at:at + lin.weight.numel()].view(shape)
        at += lin.weight.numel()
    nbytes, blocks = arena.numel(), sum(n * k // 32 for n, k in SHAPES)
    xs = {k: torch.randn(1, k, generator=gen) for k in (576, 1536)}
    small, x_small = lins[4], xs[576]  # gate: 1536 x 576
    small_calls = 200
    as_i64 = arena[: nbytes // 8 * 8].view(torch.int64)
    t = {"dram_pass": [], "read": [], "l2_call": []}
    for _ in range(repeats):  # alternating
        t0 = time.perf_counter()
        for lin in lins:
            lin(xs[lin.in_features])
        t["dram_pass"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        as_i64.sum()
        t["read"].append(time.perf_counter() - t0)
        small(x_small)
        t0 = time.perf_counter()
        for _ in range(small_calls):
            small(x_small)
        t["l2_call"].append((time.perf_counter() - t0) / small_calls)
    med = {k: statistics.median(v) for k, v in t.items()}
    small_blocks = small.weight.numel() // 20
    out = {"machine": where, "threads": threads, "repeats": repeats, "bytes": nbytes,
           "dram_pass_ms": med["dram_pass"] * 1e3, "dram_gb_per_s": nbytes / med["dram_pass"] / 1e9,
           "dram_ns_per_block_row": med["dram_pass"] / blocks * 1e9,
           "plain_read_gb_per_s": nbytes / med["read"] / 1e9,
           "l2_ns_per_block_row": med["l2_call"] / small_blocks * 1e9,
           "l2_gb_per_s": small.weight.numel() / med["l2_call"] / 1e9, "samples_s": t}
    print(f"{threads} thread(s): one pass over {nbytes / 1e6:.0f} MB of Q4_1 blocks "
          f"{out['dram_pass_ms']:.2f} ms ({out['dram_gb_per_s']:.1f} GB/s, "
          f"{out['dram_ns_per_block_row']:.2f} ns a block-row); a plain read of the same bytes "
          f"{out['plain_read_gb_per_s']:.1f} GB/s; one 1536 x 576 matrix from cache "
          f"{out['l2_ns_per_block_row']:.2f} ns a block-row ({out['l2_gb_per_s']:.1f} GB/s)", flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args()
    run(a.threads, a.repeats, a.json)


if __name__ == "__main__":
    main()
