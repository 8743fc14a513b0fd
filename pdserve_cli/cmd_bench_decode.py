"""`pdserve bench decode [--json FILE]`: CPU decode attention, the compiled kernel reading the
paged pool in place against the decode mirror and the block gather, on the tiny and SmolLM2
shapes. The benchmark itself is `bench.cpu_decode`."""

from __future__ import annotations

import argparse

NAME = "decode"
HELP = "CPU decode attention: compiled kernel (pool in place) vs decode mirror vs block gather"
GROUP = "bench"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="FILE", help="write the results here (and a .png chart)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per path per round (default 16)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three paths in turn (default 3)")


def run(args: argparse.Namespace) -> int:
    from bench.cpu_decode import run as bench

    bench(json_path=args.json, steps=args.steps, rounds=args.rounds)
    return 0
