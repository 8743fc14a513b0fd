"""The `--weights` flag and its one default, for every command that builds an engine or a cluster:
`serve`, `up`, `demo`, `generate --local` and `profile` all call `resolve`, so the in-process
engine and the cluster compute in the same format unless the user asks otherwise (each response's
`system_fingerprint` says which: coordinator.completion). Torch-free: `up` never loads torch.

Formats are engine.weight_format's: `f32` (float32 as loaded; the transformers-equality tests'
format), `bf16` (matrices stored as bfloat16, float32 sums), `int8` (per-output-row scale) and
`gguf` (a GGUF model's own Q4_1/Q8_0 blocks, computed on directly; other matrices bf16) and
`gguf-q8` (the same blocks, activations rounded to int8 blocks as llama.cpp does). The default on
CPU comes from `pdserve bench weights` on SmolLM2 (2 cores): a GGUF model gets `gguf`, which holds
exactly the weights f32 holds (the file's blocks are what f32 dequantizes), so its greedy tokens
equal f32's, while a decode step reads 96 MB instead of 538 and runs 5-6x faster; any other model
gets bf16 (99.4% top-1 agreement with f32, perplexity within 0.1%, 1.4x faster); int8 (2.1x)
agrees on 95.6% of positions only, and gguf-q8 (1.2-1.6x gguf's speed) on 95.4%, its greedy
tokens leaving f32's as early as the 5th, so both stay opt-ins. GPUs keep f32 (their dtype is
--dtype). Library callers that build an EngineConfig themselves get its own default, f32.
"""

from __future__ import annotations

CHOICES = ("f32", "bf16", "int8", "gguf", "gguf-q8")
SERVING_DEFAULT = "bf16"  # on CPU, for a model that is not a GGUF file
DEFAULT_HELP = "gguf for GGUF models, else bf16, on CPU; f32 on GPUs"


def add_argument(parser, default_help: str = DEFAULT_HELP) -> None:
    parser.add_argument("--weights", choices=CHOICES, default=None,
                        help=f"how the engine stores its weight matrices (default: {default_help})")


def resolve(flag: str | None, device: str | None, *models: str | None) -> str:
    """The flag if given, else the default for `device` (None: cpu) and the --model values the
    engines load (None entries ignored): gguf when every one is a GGUF file, else bf16; f32 off CPU."""
    from model_files.gguf import is_gguf_spec

    if flag:
        return flag
    if (device or "cpu") != "cpu":
        return "f32"
    named = [m for m in models if m]
    return "gguf" if named and all(map(is_gguf_spec, named)) else SERVING_DEFAULT
