"""Weight formats (`--weights f32|bf16|int8|gguf|gguf-q8`): how a float32 CPU model stores its matrices.

`f32` leaves the model as loaded (the transformers-equality tests' format). `bf16` rounds every
projection and the logits/embedding matrix to bfloat16; `int8` to symmetric int8 with one float32
scale per output row (engine.cpu_lowp.quantize_*). `apply(model, name)` writes the rounded values
back into the float32 parameters (so embeddings, prefill rows through oneDNN and the model's
identity hash all see the weights the format stands for) and gives each Projection, and the
logits, a `LowpLinear` that decode-sized row counts run through: those read 2x or 4x fewer
bytes. `gguf` (a GGUF model only) keeps the file's own Q4_1/Q8_0 blocks (model_files.gguf.raw_blocks,
passed as `blocks`) for each matrix whose parts are all of one such type, in an
engine.cpu_gguf.GgufLinear; the float32 parameters already hold exactly those blocks' values and
stay as they are; matrices of other types fall back to bf16, with a logged note. `gguf-q8` keeps
the same blocks and rounds x to int8 blocks before each product (llama.cpp's way: integer dot
products, engine/csrc/gguf_q8.c). Both put the blocks in one huge-page mapping (engine.arena).
Call it after
the weights are loaded and before `pack_cpu_gemm`. Without the compiled kernel the rounded
float32 weights still apply (same numbers, float32 speed) and a warning says so. A rounding
format is one entry of FORMATS.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine import arena, cpu_gguf, cpu_lowp

log = logging.getLogger(__name__)

Quantizer = Callable[[torch.Tensor], tuple[torch.Tensor, "torch.Tensor | None"]]
# name -> weight (N, K) float32 -> (stored (N, K), per-row scale (N,) or None); None: unchanged
FORMATS: dict[str, Quantizer | None] = {
    "f32": None,
    "bf16": cpu_lowp.quantize_bf16,
    "int8": cpu_lowp.quantize_int8,
}
GGUF = "gguf"  # the GGUF file's own blocks: not a rounding of the float32 weights
GGUF_ACTS = {GGUF: "f32", "gguf-q8": "q8"}  # GGUF formats -> how x enters the products (engine.cpu_gguf)
NAMES = (*FORMATS, *GGUF_ACTS)
DEFAULT = "f32"


def computed_in(weights: str, dtype: str) -> str:
    """What a model loaded with `weights` computes in, as responses name it (their
    `system_fingerprint`): the weight format on a float32 model; else its dtype (formats apply to
    float32 CPU models only; a GPU's bfloat16 model computes in `bf16`)."""
    if dtype == "float32":
        return check_name(weights)
    return {"bfloat16": "bf16", "float16": "f16"}.get(dtype, dtype)


def check_name(name: str) -> str:
    if name not in NAMES:
        raise ValueError(f"unknown weight format {name!r}; choose from {', '.join(NAMES)}")
    return name


def _round(param: torch.Tensor, quantize: Quantizer, kernel: bool,
           bias: torch.Tensor | None) -> cpu_lowp.LowpLinear | None:
    """Quantize param (N, K) in place (it keeps the dequantized float32 values); the kernel's
    LowpLinear over the stored form, or None without the kernel."""
    stored, scale = quantize(param.data)
    with torch.no_grad():
        param.copy_(cpu_lowp.dequantize(stored, scale))
    return cpu_lowp.LowpLinear(stored, scale, bias) if kernel else None


def apply(model, name: str, blocks: dict | None = None) -> dict:
    """Store `model`'s (a float32 CPU engine.model.LlamaModel) matrices in format `name`.
    blocks: for `gguf`, model_files.gguf.GGUFFile.raw_blocks keyed by checkpoint_views names.
    Returns {'format', 'kernel', 'weight_bytes'}: weight_bytes is what one decode step through
    the kernel reads from the matrices (float32 bytes for f32 or without the kernel)."""
    from engine.cpu_gemm import Projection

    if check_name(name) in GGUF_ACTS:
        if blocks is None:
            raise ValueError(f"--weights {name} computes on a GGUF file's own blocks: load a GGUF model "
                             "(a .gguf path or a shipped name such as smollm2), or choose f32, bf16 or int8")
        _check_cpu_float32(model, name)
        return _apply_gguf(model, blocks, name)
    quantize = FORMATS[name]
    if quantize is None:
        return {"format": name, "kernel": False, "weight_bytes": decode_weight_bytes(model)}
    _check_cpu_float32(model, name)
    kernel = cpu_lowp.available()
    if not kernel:
        log.warning("weights %s: no compiled gemv kernel; the rounded weights run in float32", name)
    for module in model.modules():
        if isinstance(module, Projection):
            module.lowp = _round(module.weight, quantize, kernel, module.bias)
    if model.lm_head is None:  # tied: the embedding matrix is the logits' weight, rounded once
        model.logits_lowp = _round(model.embed_tokens.weight, quantize, kernel, None)
    else:
        model.logits_lowp = model.lm_head.lowp
    return {"format": name, "kernel": kernel, "weight_bytes": decode_weight_bytes(model)}


def _apply_gguf(model, blocks: dict, name: str) -> dict:
    """`gguf`, `gguf-q8`: each Projection (and tied logits) whose parts' blocks are all of one
    kernel type gets a GgufLinear over their rows stacked in parameter order; the rest round to
    bf16. The blocks then move into one huge-page mapping."""
    from engine.cpu_gemm import Projection

    act = GGUF_ACTS[name]
    kernel, lowp_kernel = cpu_gguf.available(act), cpu_lowp.available()
    if not kernel:
        log.warning("weights %s: no compiled GGUF block kernel; the same weights run in float32", name)
    parts: dict[int, list[tuple[int, str]]] = {}  # weight storage -> (row offset, checkpoint name)
    for key, view in model.checkpoint_views().items():
        if key.endswith(".weight"):
            parts.setdefault(view.untyped_storage().data_ptr(), []).append((view.storage_offset(), key))
    fallback: dict[str, str] = {}

    def linear(weight: torch.Tensor, bias: torch.Tensor | None):
        names = [key for _, key in sorted(parts[weight.untyped_storage().data_ptr()])]
        types = {blocks[k][0] if k in blocks else "absent" for k in names}
        qtype = types.pop() if len(types) == 1 else None
        if qtype in cpu_gguf.TYPES:
            rows = torch.cat([torch.from_numpy(blocks[k][1]) for k in names])  # (N, bytes per row)
            _verify(rows, qtype, weight.detach(), names[0])
            return cpu_gguf.GgufLinear(rows, qtype, bias, act=act) if kernel else None
        fallback[" + ".join(names)] = " + ".join(blocks[k][0] if k in blocks else "absent" for k in names)
        return _round(weight, cpu_lowp.quantize_bf16, lowp_kernel, bias)

    for module in model.modules():
        if isinstance(module, Projection):
            module.lowp = linear(module.weight, module.bias)
    tied = model.lm_head is None
    model.logits_lowp = linear(model.embed_tokens.weight, None) if tied else model.lm_head.lowp
    if fallback:
        log.warning("weights %s: %d matrices are not all %s in the file; stored as bf16: %s", name,
                    len(fallback), " or ".join(cpu_gguf.TYPES),
                    "; ".join(f"{k} ({v})" for k, v in fallback.items()))
    every = [*(getattr(m, "lowp", None) for m in model.modules()), model.logits_lowp]
    # each once (an untied lm_head is also a Projection)
    linears = {id(lin): lin for lin in every if isinstance(lin, cpu_gguf.GgufLinear)}
    for lin, moved in zip(linears.values(), arena.into_arena([lin.weight for lin in linears.values()])):
        lin.weight = moved
    return {"format": name, "kernel": kernel, "weight_bytes": decode_weight_bytes(model),
            "fallback": fallback}


def _verify(rows: torch.Tensor, qtype: str, weight: torch.Tensor, name: str) -> None:
    """The blocks of some rows (every N/8th and the last) widen to exactly the loaded weights."""
    n = rows.shape[0]
    idx = torch.unique(torch.cat([torch.arange(0, n, max(1, n // 8)), torch.tensor([n - 1])]))
    if tuple(rows.shape) != (weight.shape[0], cpu_gguf.row_bytes(qtype, weight.shape[1])) or not torch.equal(
            cpu_gguf.dequantize(rows[idx], qtype), weight[idx]):
        raise RuntimeError(f"the {qtype} blocks of {name} do not match its loaded float32 weights")


def _check_cpu_float32(model, name: str) -> None:
    weight = model.embed_tokens.weight
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"--weights {name} applies to float32 models on CPU (this one is {weight.dtype} on "
                         f"{weight.device.type}); on GPUs choose --dtype instead")


def decode_weight_bytes(model) -> int:
    """Bytes of matrices one single-row decode step reads on `model` as it is set up now."""
    from engine.cpu_gemm import Projection

    total = 0
    for m in model.modules():
        if isinstance(m, Projection):
            total += m.lowp.nbytes if getattr(m, "lowp", None) is not None else _nbytes(m.weight)
    if model.lm_head is None:
        lowp = getattr(model, "logits_lowp", None)
        total += lowp.nbytes if lowp is not None else _nbytes(model.embed_tokens.weight)
    return total


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
