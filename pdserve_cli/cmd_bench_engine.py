"""`pdserve bench engine`: engine tokens/s and step latency beside transformers `generate`, and beside
llama.cpp on the same GGUF when llama-cpp-python is installed (single stream and batched)."""

from __future__ import annotations

from pdserve_cli.weights_arg import CHOICES, SERVING_DEFAULT

NAME = "engine"
GROUP = "bench"
HELP = "engine throughput vs Hugging Face transformers generate (and llama.cpp on a GGUF) on the same prompts"


def add_arguments(p) -> None:
    p.add_argument("--json", help="write the result JSON here")
    p.add_argument("--model", default="tiny",
                   help="'tiny' (a random 4-layer Llama written for the run), 'smollm2', a .gguf path or a "
                        "checkpoint directory; both sides load it")
    p.add_argument("--preset", choices=("short", "long"), default="short",
                   help="prompt lengths: short 16..128, long 480..512 tokens (--min/--max-prompt override)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=None)
    p.add_argument("--max-prompt", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-batched-tokens", type=int, default=None,
                   help="engine step budget: one token per decoding sequence plus prefill chunks (default: "
                        "256 for tiny, 128 for real models; either keeps a prefill-carrying step within ~3x "
                        "a decode-only one on the long preset on CPU)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="both sides")
    p.add_argument("--device", default="cpu",
                   help="both sides' device: cpu or cuda[:i] (on cuda the engine attends with Triton)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="alternating runs of each side (medians reported)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads for both sides, and llama.cpp's threads (default 1: steadier "
                        "on small machines)")
    p.add_argument("--weights", choices=CHOICES, default="f32",
                   help="pdserve's weight format on CPU (default f32, whose outputs equal transformers'; "
                        f"serving defaults to {SERVING_DEFAULT} on CPU)")
    p.add_argument("--no-llamacpp", action="store_true",
                   help="leave llama.cpp out (it runs by default on a GGUF model when llama-cpp-python is "
                        "installed: same file, prompts and threads)")


def run(args) -> int:
    import torch

    from bench.engine_speed import run as bench

    torch.set_num_threads(args.threads)

    bench(num_prompts=args.num_prompts, max_tokens=args.max_tokens, min_prompt=args.min_prompt,
          max_prompt=args.max_prompt, block_size=args.block_size, seed=args.seed, repeats=args.repeats,
          json_path=args.json, model=args.model, preset=args.preset,
          max_batched_tokens=args.max_batched_tokens, dtype=args.dtype, device=args.device,
          weights=args.weights, llamacpp=not args.no_llamacpp)
    return 0
