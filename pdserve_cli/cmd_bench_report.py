"""`pdserve bench report [--results DIR] [--out FILE] [--check]`: writes docs/results.md from the
latest run of each benchmark kept under docs/results/<machine>/<bench>.json. The report itself is
`bench.report`; `--check` only compares, for CI and for the test that keeps the committed file
current."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

NAME = "report"
HELP = "write docs/results.md from docs/results/<machine>/<bench>.json (the latest run of each bench)"
GROUP = "bench"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", default="docs/results", metavar="DIR",
                        help="the results folder, one subfolder per machine (default docs/results)")
    parser.add_argument("--out", default="docs/results.md", metavar="FILE",
                        help="the Markdown to write (default docs/results.md)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if FILE differs from what the JSON gives")


def run(args: argparse.Namespace) -> int:
    from bench import report_serving
    from bench.report import ResultsError, load, render

    try:
        if not args.check:  # the serving study's plot first: the report links it where it exists
            for machine, runs in load(Path(args.results)).items():
                if report_serving.plot(runs, Path(args.results) / machine / report_serving.PLOT):
                    print(f"wrote {Path(args.results) / machine / report_serving.PLOT}")
        text = render(Path(args.results))
    except ResultsError as exc:
        print(f"pdserve bench report: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if args.check:
        current = out.read_text() if out.exists() else ""
        if current != text:
            print(f"{out} is not what {args.results} gives: run `pdserve bench report`", file=sys.stderr)
            return 1
        print(f"{out} is current")
        return 0
    out.write_text(text)
    print(f"wrote {out} ({len(text.splitlines())} lines)")
    return 0
