"""`pdserve bench netns`: KV migration (zmq-tcp, ray through the object store, nixl) from the Ray head
to a Ray node in its own network and mount namespace, against a raw TCP stream over the same veth,
at each link rate given (bench.netns); with `--serve`, bench serve's load on 1 prefill + 1 decode
with the two workers on two namespaced nodes against both on one (bench.netns_serve). Root only."""

from __future__ import annotations

import json
import sys

NAME = "netns"
HELP = ("KV migration (zmq, ray, nixl) across a namespaced node's link against raw TCP, per link rate; "
        "--serve: serving with prefill and decode on two nodes against one (root)")
GROUP = "bench"


def add_arguments(p) -> None:
    p.add_argument("--rates", default="unlimited,1gbit",
                   help="comma-separated link rates, tc syntax or 'unlimited' (default unlimited,1gbit)")
    p.add_argument("--kv-shape", default="llama3-8b",
                   help="tiny | llama3-8b | L,H,D,dtype (default llama3-8b)")
    p.add_argument("--tokens", default="256,1024", help="comma-separated token counts (default 256,1024)")
    p.add_argument("--repeats", type=int, default=4, help="timed transfers per point (default 4)")
    p.add_argument("--serve", action="store_true",
                   help="serving across nodes instead: bench serve's quick load (tiny model), prefill "
                        "and decode on two nodes, then both on one node")
    p.add_argument("--transport", default="zmq", help="--serve: the cluster's KV transport (default zmq)")
    p.add_argument("--link-rate", default=None,
                   help="--serve: shape the decode node's link to this rate (tc syntax), two-node layout")
    p.add_argument("--serve-rates", default=None,
                   help="--serve: comma-separated request rates (default: bench serve --quick's)")
    p.add_argument("--num-requests", type=int, default=None, help="--serve: requests per rate")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")


def _serve(args) -> dict:
    from dataclasses import replace

    from bench import netns_serve
    from measure.serve import QUICK

    cfg = QUICK
    if args.serve_rates:
        cfg = replace(cfg, rates=tuple(float(r) for r in args.serve_rates.split(",") if r.strip()))
    if args.num_requests:
        cfg = replace(cfg, num_requests=args.num_requests)
    report = netns_serve.run_bench(cfg, args.transport, args.link_rate)
    print(netns_serve.summary(report))
    return report


def run(args) -> int:
    from bench import netns

    try:
        if args.serve:
            report = _serve(args)
        else:
            tokens = tuple(int(x) for x in args.tokens.split(",") if x.strip())
            rates = tuple(r.strip() for r in args.rates.split(",") if r.strip())
            if not tokens or not rates or args.repeats < 1:
                raise ValueError("give at least one rate and token count, and --repeats >= 1")
            report = netns.run_bench(rates, args.kv_shape, tokens, args.repeats)
            print(netns.summary(report))
    except (ValueError, RuntimeError) as e:
        print(f"pdserve bench netns: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0
