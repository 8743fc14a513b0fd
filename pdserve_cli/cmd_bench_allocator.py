"""`pdserve bench allocator`: allocate/free/fork/append operations per second of the block allocator
and KV cache manager on pools of 10^3..10^6 blocks, showing that cost per operation does not grow
with pool size. Prints a table and progress lines; `--json FILE` writes the full record.
"""

from __future__ import annotations

import json
import sys

NAME = "allocator"
HELP = "block allocator / manager operations per second against pool size"
GROUP = "bench"


def _sizes(text: str) -> tuple[int, ...]:
    import argparse

    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes:
        raise argparse.ArgumentTypeError("need at least one pool size")
    return sizes


def add_arguments(parser) -> None:
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--sizes", type=_sizes, default=(1_000, 10_000, 100_000, 1_000_000),
                        metavar="N,N,...", help="pool sizes in blocks (default 1000,10000,100000,1000000)")
    parser.add_argument("--ops", type=int, default=200_000, metavar="N",
                        help="timed operations of each kind per pool size (default 200000)")
    parser.add_argument("--repeats", type=int, default=3, metavar="N",
                        help="run each phase N times and report the fastest (default 3)")


def run(args) -> int:
    from bench.allocator import BenchConfig, format_results, run_bench

    try:
        cfg = BenchConfig(sizes=tuple(args.sizes), ops=args.ops, repeats=args.repeats)
    except ValueError as e:
        print(f"pdserve bench allocator: {e}", file=sys.stderr)
        return 2
    record = run_bench(cfg, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_results(record))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {args.json}")
    return 0
