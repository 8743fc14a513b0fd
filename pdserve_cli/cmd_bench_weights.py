"""`pdserve bench weights [--json FILE]`: the weight formats (f32, bf16, int8, gguf, gguf-q8) on
SmolLM2: greedy agreement and perplexity against f32, decode step time and tokens/s, and bytes read per step
against the memory bandwidth measured in the same run. The benchmark itself is `bench.weights`."""

from __future__ import annotations

import argparse

NAME = "weights"
HELP = "weight formats on SmolLM2: agreement and perplexity vs f32, decode speed, bandwidth use"
GROUP = "bench"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="FILE", help="write the results here")
    parser.add_argument("--formats", default="f32,bf16,int8,gguf,gguf-q8",
                        help="comma-separated (f32 always runs first)")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens per run (default 48)")
    parser.add_argument("--batch", type=int, default=8, help="sequences in the batched run (default 8)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def run(args: argparse.Namespace) -> int:
    import torch

    from bench.weights import run as bench

    if args.threads:
        torch.set_num_threads(args.threads)
    formats = tuple(f.strip() for f in args.formats.split(",") if f.strip())
    bench(formats, args.new_tokens, args.batch, args.json)
    return 0
