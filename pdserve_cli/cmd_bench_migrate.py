"""`pdserve bench migrate`: KV migration pool -> pool over ZeroMQ (tcp, ipc) and Ray, against
memcpy, a well-made raw TCP socket, Ray put/get, pickle over a pipe and NIXL (when installed);
prints ratios and the fixed overhead (intercept of a latency-vs-bytes fit), writes JSON, a plot,
and the migration timeline as a Chrome trace (`--trace`, opens in Perfetto)."""

from __future__ import annotations

NAME = "migrate"
HELP = "benchmark KV migration between pools (every transport and variant) against baselines"
GROUP = "bench"


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="a representative subset (minutes on 2 cores)")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot latency vs tokens and GB/s vs baselines")
    p.add_argument("--trace", metavar="FILE.json",
                   help="write every timed migration's spans (export, wire; receiver prepare, land, verify, "
                        "commit) as Chrome trace JSON (Perfetto, chrome://tracing)")
    p.add_argument("--kv-shape", action="append", metavar="SHAPE",
                   help="tiny | llama3-8b | L,H,D,dtype (repeatable; default: tiny and llama3-8b)")
    p.add_argument("--tokens", type=_ints, help="comma-separated token counts (e.g. 256,1024,4096)")
    p.add_argument("--block-sizes", type=_ints, help="comma-separated block sizes (default 16)")
    p.add_argument("--transports",
                   help="comma-separated, of: zmq-tcp,zmq-ipc,zmq-frames,zmq-shm,nixl,ray,ray-store "
                        "(default: all)")
    p.add_argument("--repeats", type=int,
                   help="timed transfers per point (default 4 in --quick, 5 otherwise; payloads up to "
                        "1 MiB get at least 30 unless given)")
    p.add_argument("--chunk-mib", type=float, help="wire chunk size in MiB (default 2)")
    p.add_argument("--inline-kib", type=int,
                   help="zmq-tcp / zmq-ipc: payloads up to this many KiB follow the manifest on the control "
                        "socket instead of the bulk link (TransportConfig.inline_bytes, default 256; 0: "
                        "every payload streams): run it twice to find the crossover")
    p.add_argument("--keyed", action="store_true",
                   help="key the ZeroMQ endpoints with a fresh cluster secret, as `pdserve up` does (CURVE "
                        "on the control socket, signed handshake)")
    p.add_argument("--no-baselines", action="store_true", help="skip the baselines")
    p.add_argument("--device", default="cpu",
                   help="both pools' device: cpu or cuda[:i] (zmq transports only; adds the pinned "
                        "host<->device copy baselines)")


def run(args) -> int:
    import json
    from dataclasses import replace

    from bench.baselines import Baselines
    from bench.migrate_report import format_summary, plot, summarize
    from measure.migrate import QUICK, BenchConfig, run_bench

    cfg = QUICK if args.quick else BenchConfig()
    over = {}
    if args.kv_shape:
        over["kv_shapes"] = tuple(args.kv_shape)
    if args.tokens:
        over["tokens"] = args.tokens
    if args.block_sizes:
        over["block_sizes"] = args.block_sizes
    if args.transports:
        over["transports"] = tuple(t.strip() for t in args.transports.split(",") if t.strip())
    if args.repeats:  # exactly this many at every size
        over.update(repeats=args.repeats, small_repeats=args.repeats, small_warmup=0)
    if args.chunk_mib:
        over["chunk_bytes"] = int(args.chunk_mib * (1 << 20))
    if args.no_baselines:
        over["baselines"] = False
    if args.device != "cpu":
        over["device"] = args.device
    if args.inline_kib is not None:
        over["inline_bytes"] = args.inline_kib << 10
    if args.keyed:
        from protocol.curve import ClusterKeys

        over["secret"] = ClusterKeys.generate().secret
    cfg = replace(cfg, **over)
    print(f"bench migrate: shapes {cfg.kv_shapes}, tokens {cfg.tokens}, block sizes {cfg.block_sizes}, "
          f"transports {cfg.transports}, repeats {cfg.repeats}", flush=True)
    report = run_bench(cfg, log=lambda s: print(s, flush=True), baselines=Baselines)
    print(format_summary(summarize(report)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot and report["results"]:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    if args.trace:
        from bench.migrate_trace import write_trace

        n = write_trace(report.get("timeline", []), args.trace)
        print(f"wrote {args.trace} ({n} trace events)")
    return 0 if all(r["verified"] for r in report["results"]) else 1
