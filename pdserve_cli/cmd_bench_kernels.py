"""`pdserve bench kernels [--json FILE]`: time the Triton paged-attention kernels (KV store, decode,
prefill) against the torch reference backend on realistic Llama-style shapes, on CUDA. Each case
also records the largest absolute difference from the reference and, for decode, the effective
bandwidth of the K/V bytes read. Without CUDA it says so, runs one tiny case per kernel under
TRITON_INTERPRET=1 through the same code (a smoke test: those times mean nothing) and exits 0.
The benchmark itself is `bench.kernels`.
"""

from __future__ import annotations

import argparse

NAME = "kernels"
HELP = "time the Triton paged-attention kernels vs the torch reference (needs CUDA)"
GROUP = "bench"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="FILE", help="write {'results': [...]} here")
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    parser.add_argument("--iters", type=int, default=20, help="timed repetitions per kernel (median)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="first case of each kernel only")


def run(args: argparse.Namespace) -> int:
    from bench.kernels import run as bench

    bench(dtype_name=args.dtype, iters=args.iters, warmup=args.warmup, quick=args.quick, json_path=args.json)
    return 0
