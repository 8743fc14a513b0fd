"""`pdserve bench gemm [--json FILE]`: CPU projections, torch's F.linear against oneDNN on packed
weights (engine.cpu_gemm), for every weight shape of the tiny and SmolLM2 models at decode and
prefill row counts. The benchmark itself is `bench.cpu_gemm`."""

from __future__ import annotations

import argparse

NAME = "gemm"
HELP = "CPU float32 projections: F.linear (MKL) vs oneDNN with packed weights, per model shape"
GROUP = "bench"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="FILE", help="write the results here")
    parser.add_argument("--model", action="append", choices=["tiny", "smollm2"],
                        help="shapes of this model (repeatable; default both)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")


def run(args: argparse.Namespace) -> int:
    import torch

    from bench.cpu_gemm import run as bench

    torch.set_num_threads(args.threads)
    bench(models=tuple(args.model or ("tiny", "smollm2")), json_path=args.json)
    return 0
