"""`pdserve bench blocksize`: does the block size that minimises KV waste also minimise TPOT and
migration time? Same traces, same KV capacity in tokens, every block size; see bench.blocksize."""

from __future__ import annotations

import sys

NAME = "blocksize"
GROUP = "bench"
HELP = ("KV block size sweep on the real engine: waste (beside the simulator), allocator and attention "
        "time, TPOT, copy-on-write, prefix hits, ZeroMQ migration and re-blocking")


def _sizes(text: str) -> tuple[int, ...]:
    sizes = tuple(int(s) for s in text.split(",") if s.strip())
    if not sizes or any(s < 1 for s in sizes) or len(set(sizes)) != len(sizes):
        raise ValueError(f"--sizes wants distinct positive integers, got {text!r}")
    return tuple(sorted(sizes))


def add_arguments(p) -> None:
    p.add_argument("--sizes", default="1,2,4,8,16,32,64,128", help="block sizes (tokens per block)")
    p.add_argument("--quick", action="store_true",
                   help="shorter traces, one timed repeat, fewer migrations (what it shortened is printed "
                        "and recorded under 'shortened')")
    p.add_argument("--json", metavar="FILE", help="write the result JSON here")
    p.add_argument("--plot", metavar="FILE.png", help="write the figure here")
    p.add_argument("--model", default="tiny",
                   help="engine model: 'tiny' (built-in random 4-layer Llama), 'smollm2', a .gguf or a "
                        "checkpoint directory")
    p.add_argument("--capacity-tokens", type=int, default=None,
                   help="KV slots of the mixed and shared traces (default 6144; quick 4096)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: steadier)")


def run(args) -> int:
    import dataclasses

    import torch

    from bench.blocksize import BlocksizeConfig, log, quick
    from bench.blocksize import run as bench

    try:
        sizes = _sizes(args.sizes)
    except ValueError as e:
        print(f"pdserve bench blocksize: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    cfg, shortened = BlocksizeConfig(sizes=sizes, model=args.model, seed=args.seed), []
    if args.quick:
        cfg, shortened = quick(cfg)
        log("quick: " + "; ".join(shortened))
    if args.capacity_tokens:
        cfg = dataclasses.replace(cfg, capacity_tokens=args.capacity_tokens)
    bench(cfg, json_path=args.json, plot_path=args.plot, shortened=shortened)
    return 0
