"""`pdserve bench flood`: N simultaneous completions against a coordinator guarded by an API key
(bench.flood): 401 without the key, every request answered 200 or 429 (with Retry-After) within a
bound, /health answering throughout, the cluster at rest afterwards. Against `--url`, or against a
`pdserve up --api-key` it launches itself (tiny model, 1 prefill + 1 decode) and stops afterwards.
Exits 1 when any of those properties fails."""

from __future__ import annotations

NAME = "flood"
GROUP = "bench"
HELP = "flood a coordinator with simultaneous requests: 200 or 429 within a bound, /health responsive"


def add_arguments(p) -> None:
    p.add_argument("--url", help="a running coordinator (e.g. http://127.0.0.1:8000); default: launch "
                   "`pdserve up` here and stop it afterwards")
    p.add_argument("--api-key", help="its API key (launched: default a random one)")
    p.add_argument("--requests", type=int, default=200, help="simultaneous requests (default 200)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per completion (default 8)")
    p.add_argument("--bound-s", type=float, default=120.0,
                   help="every request must end within this many seconds of the release (default 120)")
    p.add_argument("--health-bound-s", type=float, default=5.0,
                   help="each /health probe must answer within this (default 5)")
    p.add_argument("--model", default="tiny", help="launched: the model (default tiny)")
    p.add_argument("--num-blocks", type=int, help="launched: KV pool size per worker")
    p.add_argument("--json", metavar="FILE", help="write the report (every request and probe) as JSON")


def run(args) -> int:
    import json
    import secrets

    from bench.flood import FloodConfig, Up, full_check

    if args.requests < 1 or args.max_tokens < 1:
        print("--requests and --max-tokens must be at least 1")
        return 2
    cfg = FloodConfig(requests=args.requests, max_tokens=args.max_tokens, bound_s=args.bound_s,
                      health_bound_s=args.health_bound_s)
    up = None
    key = args.api_key
    url = args.url
    if url is None:
        key = key or secrets.token_hex(8)
        up_args = ["--model", args.model, "--prefill", "1", "--decode", "1", "--port", "0"]
        if args.num_blocks:
            up_args += ["--num-blocks", str(args.num_blocks)]
        print("bench flood: launching PDSERVE_API_KEY=<key> pdserve up " + " ".join(up_args), flush=True)
        up = Up(up_args, env={"PDSERVE_API_KEY": key})  # NOTE: never on a command line (ps shows it)
        url = up.url
    elif not key:
        print("--url needs --api-key (the check starts with requests without it)")
        return 2
    try:
        print(f"bench flood: {cfg.requests} simultaneous requests of {cfg.max_tokens} tokens to {url}",
              flush=True)
        report = full_check(url.rstrip("/"), key, cfg, log=lambda s: print(s, flush=True))
    finally:
        if up is not None:
            rc = up.stop()
            print(f"pdserve up stopped (exit {rc})")
            if rc != 0:
                print(up.output[-3000:])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    bad = report["summary"]["violations"]
    print(f"total {report['total_s']:.1f} s; " + (f"{len(bad)} violation(s)" if bad else "all checks hold"))
    return 1 if bad else 0
