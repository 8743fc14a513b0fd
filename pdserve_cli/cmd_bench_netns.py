"""`pdserve bench netns`: KV migration (zmq-tcp, ray through the object store) from the Ray head
to a Ray node in its own network and mount namespace, against a raw TCP stream over the same veth,
at each link rate given (bench.netns; root only)."""

from __future__ import annotations

import json
import sys

NAME = "netns"
HELP = "KV migration across a namespaced node's link (zmq-tcp, ray) against raw TCP, per link rate (root)"
GROUP = "bench"


def add_arguments(p) -> None:
    p.add_argument("--rates", default="unlimited,1gbit",
                   help="comma-separated link rates, tc syntax or 'unlimited' (default unlimited,1gbit)")
    p.add_argument("--kv-shape", default="llama3-8b",
                   help="tiny | llama3-8b | L,H,D,dtype (default llama3-8b)")
    p.add_argument("--tokens", default="256,1024", help="comma-separated token counts (default 256,1024)")
    p.add_argument("--repeats", type=int, default=4, help="timed transfers per point (default 4)")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")


def run(args) -> int:
    from bench import netns

    try:
        tokens = tuple(int(x) for x in args.tokens.split(",") if x.strip())
        rates = tuple(r.strip() for r in args.rates.split(",") if r.strip())
        if not tokens or not rates or args.repeats < 1:
            raise ValueError("give at least one rate and token count, and --repeats >= 1")
        report = netns.run_bench(rates, args.kv_shape, tokens, args.repeats)
    except (ValueError, RuntimeError) as e:
        print(f"pdserve bench netns: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(netns.summary(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0
