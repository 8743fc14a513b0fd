"""`pdserve profile`: measure, on this machine, what a serving performance model needs for one
model, block size and device (prefill time against prompt length and cached prefix, decode step
time against batch size and context, KV migration time against bytes over one transport
and, unless --no-serving, the serving path's per-request and per-token overheads (real clusters,
sequential requests) and the contention of two engines stepping at once), write it as JSON and
print a short table with the fitted rates and the suggested `local_prefill_max_tokens` for
`ClusterConfig` (planner.profile)."""

from __future__ import annotations

from pdserve_cli import weights_arg

NAME = "profile"
GROUP = None
HELP = "measure prefill, decode step and KV migration times on this machine (JSON + table)"


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="a few points, few repeats (under a minute on tiny)")
    p.add_argument("--model", help="'smollm2' (default, as `pdserve up`), 'tiny', a .gguf file or a "
                   "checkpoint directory; `pdserve plan` finds the JSON by itself named profile-MODEL.json")
    p.add_argument("--block-size", type=int, help="KV block size (default 16)")
    p.add_argument("--device", help="cpu (default) or cuda[:i]")
    weights_arg.add_argument(p)
    p.add_argument("--transport", help="bench migrate's transport: zmq-tcp (default), zmq-ipc, ray")
    p.add_argument("--prompt-lens", type=_ints, help="comma-separated prefill prompt lengths")
    p.add_argument("--batch-sizes", type=_ints, help="comma-separated decode batch sizes")
    p.add_argument("--no-serving", action="store_true",
                   help="time the engine only: skip the serving path's overheads and the contention factor")
    p.add_argument("--json", metavar="FILE", help="write the profile as JSON")


def run(args) -> int:
    import json
    from dataclasses import replace

    from planner.profile import QUICK, ProfileConfig, format_profile, run_profile

    cfg = QUICK if args.quick else ProfileConfig()
    over = {k: v for k, v in (("model", args.model), ("block_size", args.block_size), ("device", args.device),
                              ("transport", args.transport), ("prompt_lens", args.prompt_lens),
                              ("batch_sizes", args.batch_sizes)) if v}
    cfg = replace(cfg, **over, serving=not args.no_serving)
    # the format `up` would serve this model in (the serving part serves the same model and weights)
    cfg = replace(cfg, weights=weights_arg.resolve(args.weights, cfg.device, cfg.model))
    report = run_profile(cfg, log=lambda s: print(s, flush=True))
    print(format_profile(report))
    print(f"({report['seconds']:.1f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    return 0
