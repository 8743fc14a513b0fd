"""The `--weights` flag of `serve`, `up`, `demo` and `generate` (torch-free: `up` never loads torch).

Formats are engine.weight_format's: `f32` (float32 as loaded; the transformers-equality tests'
format), `bf16` (matrices stored as bfloat16, float32 sums) and `int8` (per-output-row scale).
`serve`, `up` and `demo` default to SERVING_DEFAULT on CPU, measured with `pdserve bench weights`
on SmolLM2 (2 cores): bf16 keeps 99.4% top-1 agreement with f32 over the shipped text and
perplexity within 0.1%, and decodes a single stream 1.4x faster; int8 is faster still (2.3x) but
agrees on 95.6% of positions only, so it stays an opt-in. GPUs keep f32 (their dtype is --dtype).
`generate` defaults to f32.
"""

from __future__ import annotations

CHOICES = ("f32", "bf16", "int8")
SERVING_DEFAULT = "bf16"


def add_argument(parser, default_help: str = "bf16 on CPU, f32 on GPUs") -> None:
    parser.add_argument("--weights", choices=CHOICES, default=None,
                        help=f"how the engine stores its weight matrices (default: {default_help})")


def resolve(flag: str | None, device: str | None) -> str:
    """The flag if given, else the serving default for `device` (None: cpu)."""
    if flag:
        return flag
    return SERVING_DEFAULT if (device or "cpu") == "cpu" else "f32"
