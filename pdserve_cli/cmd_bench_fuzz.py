"""`pdserve bench fuzz`: mutated manifests, control messages and bulk links against a live KV
receiver in a child process (bench.fuzz); reports cases, crashes, hangs, leaks and false positives
(valid transfers refused or landed wrong), per mutation family with the typed codes it was refused
with. Exit status 1 unless all four are 0."""

from __future__ import annotations

NAME = "fuzz"
HELP = "fuzz the KV receiver: mutated manifests, control messages and bulk links; crashes/hangs/leaks"
GROUP = "bench"


def add_arguments(p) -> None:
    p.add_argument("--cases", type=int, default=10_000, help="cases to run (default 10000)")
    p.add_argument("--seed", type=int, default=0, help="seed; a case is reproduced by seed and index")
    p.add_argument("--batch", type=int, help="cases between leak checks (default 1000)")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")


def run(args) -> int:
    import json
    import os
    import sys

    from bench.fuzz import FuzzConfig, run_fuzz

    if args.cases < 1:
        print("--cases must be at least 1", file=sys.stderr)
        return 2
    over = {"cases": args.cases, "seed": args.seed}
    if args.batch:
        over["batch"] = args.batch
    report = run_fuzz(FuzzConfig(**over))
    print(f"cases {report['cases']}, crashes {report['crashes']}, hangs {report['hangs']}, "
          f"leaks {report['leaks']}, false positives {report['false_positives']} "
          f"({report['leak_checks']} leak checks, {report['seconds']:.0f} s)")
    for name, fam in report["by_mutation"].items():
        ranked = sorted(fam["refused_by_code"].items(), key=lambda kv: -kv[1])
        codes = ", ".join(f"{k} {v}" for k, v in ranked)
        print(f"  {name:18s} {fam['cases']:7d}  {codes}")
    for ex in report["examples"][:5]:
        print(f"  {ex['kind']} at case {ex['case']} ({ex['family']}/{ex['op']}): {ex['detail'][:300]}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    bad = report["crashes"] + report["hangs"] + report["leaks"] + report["false_positives"]
    return 1 if bad else 0
