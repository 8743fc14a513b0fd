"""Entry point of the `pdserve` console script: collects the cmd_* modules into subcommands."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import pdserve_cli


def _command_modules():
    for info in sorted(pkgutil.iter_modules(pdserve_cli.__path__), key=lambda i: i.name):
        if info.name.startswith("cmd_"):
            yield importlib.import_module(f"pdserve_cli.{info.name}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Prefill/decode-disaggregated LLM serving with a paged KV cache.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench = sub.add_parser("bench", help="benchmarks that write JSON (and plots)")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    bench.set_defaults(_parser=bench)
    for mod in _command_modules():
        target = bench_sub if mod.GROUP == "bench" else sub
        p = target.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run = getattr(args, "_run", None)
    if run is None:
        (getattr(args, "_parser", None) or parser).print_help()
        return 2
    try:
        return int(run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
