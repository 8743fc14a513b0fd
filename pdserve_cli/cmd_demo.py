"""`pdserve demo`: the README's main job (`make demo` runs it).

1. A disaggregated cluster on an embedded local Ray: 1 prefill + 1 decode worker serving
   SmolLM2-135M-Instruct (--model smollm2, the default; `tiny` is labelled a random model), KV
   migrated over ZeroMQ (or Ray with --transport ray). It sends a handful of requests over HTTP
   (two sharing a long prefix, one with n=2, one streamed chat), prints each answer's text with
   its migration (blocks, bytes, ms, transport) and TTFT/TPOT, then the ownership ledger's end
   state (nothing owned), and shuts everything down, the Ray it started included.
2. Then, with a sentence on why: the allocator-policy simulator on the shipped trace (table,
   JSON and figure under --out).
The demo itself is `pdserve_cli.demo`.
"""

from __future__ import annotations

from pdserve_cli import transport_arg, weights_arg

NAME = "demo"
GROUP = None
HELP = "run the main demo: a 1 prefill + 1 decode cluster on local Ray, then the allocator-policy study"


def add_arguments(p) -> None:
    p.add_argument("--out", default="out/demo", help="folder for the JSON and figure (default out/demo)")
    transport_arg.add(p, default="zmq")
    p.add_argument("--model", default="smollm2", help="'smollm2' (default: SmolLM2-135M-Instruct), 'tiny' "
                   "(random test model), a .gguf file or a Hugging Face checkpoint directory")
    p.add_argument("--block-size", type=int, default=16, help="prefill worker's KV block size")
    p.add_argument("--decode-block-size", type=int, default=0,
                   help="decode worker's KV block size (0: same; a different one is re-blocked)")
    weights_arg.add_argument(p)


def run(args) -> int:
    from pdserve_cli.demo import run as demo

    return demo(out=args.out, transport=args.transport, block_size=args.block_size,
                decode_block_size=args.decode_block_size, model=args.model,
                weights=weights_arg.resolve(args.weights, "cpu", args.model))
