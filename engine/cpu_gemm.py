"""Float32 projections on CPU through oneDNN, with each weight packed once at load time.

torch's float32 `F.linear` on x86 calls MKL's sgemm. On this project's CPUs (AMD EPYC, AVX-512)
it runs well below the core's peak, worst with few rows: a decode step's 8..32 rows reach 25-60
GFLOP/s. oneDNN (torch's built-in `torch.ops.mkldnn` linear ops) with a weight reordered once
into its blocked layout runs the same float32 arithmetic 1.1-2.5x faster on weights of 128k
elements and more (`pdserve bench gemm` measures both side by side). `pack(weight, bias)`
returns a `PackedLinear`, or None where the path does not apply: a tensor not on CPU or not
float32, a weight too small to pay for oneDNN's dearer call, or a torch without oneDNN. Results
are float32 summed in another order than MKL's: they differ from `F.linear` in the last bits, as
two BLAS libraries do, not in precision. Each packed weight costs one more copy in memory (the
plain weights stay, for identity hashing and any later repacking).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACK_ROWS_HINT = 128  # rows oneDNN picks its blocked layout for; any row count runs (8..512 within ~5%)
# oneDNN's call costs ~10 us more than F.linear's: it pays from about 128k weight elements (a
# 512x256 weight breaks even at 8..256 rows; 576x576 is 1.1-1.3x faster; 128x128 is 0.4-1.0x).
MIN_PACKED_ELEMENTS = 1 << 17


def available() -> bool:
    ops = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and all(
        hasattr(ops, name) for name in ("_linear_pointwise", "_reorder_linear_weight"))


class PackedLinear:
    """y = x @ weight.T + bias with the weight in oneDNN's layout: x (..., in) -> (..., out)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
        self.bias = None if bias is None else bias.detach()
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None,
         min_elements: int = MIN_PACKED_ELEMENTS) -> PackedLinear | None:
    """A PackedLinear for (weight (out, in), bias (out,) or None), or None where oneDNN does not
    apply or does not pay (fewer than `min_elements` weight elements)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2 or not available():
        return None
    if weight.numel() < min_elements:
        return None
    return PackedLinear(weight, bias)


class Projection(torch.nn.Linear):
    """nn.Linear that runs through its PackedLinear once `pack_cpu` gave it one."""

    packed: PackedLinear | None = None
    lowp = None  # engine.cpu_lowp.LowpLinear: bf16/int8 weights for a few rows (engine.weight_format)

    def pack_cpu(self, enabled: bool, min_elements: int = MIN_PACKED_ELEMENTS) -> None:
        """Pack the current weight (enabled, and where `pack` applies) or drop the packed copy."""
        self.packed = pack(self.weight, self.bias, min_elements) if enabled else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        lowp = self.lowp
        if lowp is not None and x.dim() == 2 and x.shape[0] <= lowp.max_rows:
            return lowp(x)  # (M, out)
        packed = self.packed
        return F.linear(x, self.weight, self.bias) if packed is None else packed(x)
