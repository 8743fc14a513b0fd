"""Weight formats (`--weights f32|bf16|int8`): how a loaded float32 CPU model stores its matrices.

`f32` leaves the model as loaded (the transformers-equality tests' format). `bf16` rounds every
projection and the logits/embedding matrix to bfloat16; `int8` to symmetric int8 with one float32
scale per output row (engine.cpu_lowp.quantize_*). `apply(model, name)` writes the rounded values
back into the float32 parameters (so embeddings, prefill rows through oneDNN and the model's
identity hash all see the weights the format stands for) and gives each Projection, and the
logits, a `LowpLinear` that decode-sized row counts run through: those read 2x or 4x fewer
bytes. Call it after the weights are loaded and before `pack_cpu_gemm`. Without the compiled
kernel the rounded float32 weights still apply (same numbers, float32 speed) and a warning says
so. A format is one entry of FORMATS.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine import cpu_lowp

log = logging.getLogger(__name__)

Quantizer = Callable[[torch.Tensor], tuple[torch.Tensor, "torch.Tensor | None"]]
# name -> weight (N, K) float32 -> (stored (N, K), per-row scale (N,) or None); None: unchanged
FORMATS: dict[str, Quantizer | None] = {
    "f32": None,
    "bf16": cpu_lowp.quantize_bf16,
    "int8": cpu_lowp.quantize_int8,
}
DEFAULT = "f32"


def check_name(name: str) -> str:
    if name not in FORMATS:
        raise ValueError(f"unknown weight format {name!r}; choose from {', '.join(FORMATS)}")
    return name


def _round(param: torch.Tensor, quantize: Quantizer, kernel: bool,
           bias: torch.Tensor | None) -> cpu_lowp.LowpLinear | None:
    """Quantize param (N, K) in place (it keeps the dequantized float32 values); the kernel's
    LowpLinear over the stored form, or None without the kernel."""
    stored, scale = quantize(param.data)
    with torch.no_grad():
        param.copy_(cpu_lowp.dequantize(stored, scale))
    return cpu_lowp.LowpLinear(stored, scale, bias) if kernel else None


def apply(model, name: str) -> dict:
    """Store `model`'s (a float32 CPU engine.model.LlamaModel) matrices in format `name`.
    Returns {'format', 'kernel', 'weight_bytes'}: weight_bytes is what one decode step through
    the kernel reads from the matrices (float32 bytes for f32 or without the kernel)."""
    from engine.cpu_gemm import Projection

    quantize = FORMATS[check_name(name)]
    if quantize is None:
        return {"format": name, "kernel": False, "weight_bytes": decode_weight_bytes(model)}
    weight = model.embed_tokens.weight
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"--weights {name} applies to float32 models on CPU (this one is {weight.dtype} on "
                         f"{weight.device.type}); on GPUs choose --dtype instead")
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


def decode_weight_bytes(model) -> int:
    """Bytes of matrices one single-row decode step reads on `model` as it is set up now."""
    from engine.cpu_gemm import Projection

    total = 0
    for m in model.modules():
        if isinstance(m, Projection):
            total += m.lowp.nbytes if getattr(m, "lowp", None) is not None else m.weight.numel() * 4
    if model.lm_head is None:
        lowp = getattr(model, "logits_lowp", None)
        total += lowp.nbytes if lowp is not None else model.embed_tokens.weight.numel() * 4
    return total
