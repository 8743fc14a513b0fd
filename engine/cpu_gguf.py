"""Projections of a few float32 rows by weights kept as a GGUF file's own Q4_1 / Q8_0 blocks.

A GGUF file stores each matrix row as blocks of 32 weights: Q4_1 in 20 bytes (f16 d, f16 m, 16
bytes of nibbles: low nibbles are elements 0..15, high nibbles 16..31; value d * q + m), Q8_0 in
34 (f16 d, 32 int8; value d * q). engine/csrc/gguf_gemv.c (built by engine.cpu_kernels) reads
those bytes (5.1x / 3.8x fewer than float32), widens each block in registers to exactly the
float32 values the `gguf` package's dequantize gives, and sums in float32, so its result is the
float32 product up to summation order. `gemv` is the launcher (it checks dtypes, shapes and
strides); `dequantize` is the same widening in torch and `reference` the product in float64, for
the tests. `GgufLinear` holds one matrix's blocks (a block never spans rows, so a fused
projection is its parts' rows stacked) and serves x (M, K) for M up to `max_rows`, like
engine.cpu_lowp.LowpLinear; engine.weight_format builds them for `--weights gguf`.
"""

from __future__ import annotations

import torch

from engine import cpu_kernels
from engine.cpu_lowp import MAX_ROWS

BLOCK = 32  # weights per block
TYPES = {"Q4_1": 20, "Q8_0": 34}  # GGML type name -> bytes per block


def available() -> bool:
    return cpu_kernels.load("gguf_gemv") is not None


def _lib():
    return cpu_kernels.require("gguf_gemv", "GGUF block gemv kernels")


def row_bytes(qtype: str, in_features: int) -> int:
    """Bytes of one row of `in_features` weights in `qtype` (a multiple of BLOCK weights)."""
    if qtype not in TYPES:
        raise ValueError(f"GGUF type {qtype!r} has no kernel here; supported: {', '.join(TYPES)}")
    if in_features % BLOCK:
        raise ValueError(f"{qtype} rows hold multiples of {BLOCK} weights, not {in_features}")
    return in_features // BLOCK * TYPES[qtype]


def _check(x: torch.Tensor, w: torch.Tensor, qtype: str, bias: torch.Tensor | None,
           out: torch.Tensor | None) -> tuple[int, int, int]:
    """(M, N, K) after checking every tensor the kernel reads or writes."""
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"x (M, K) and w (N, row bytes) expected, got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != torch.float32 or w.dtype != torch.uint8:
        raise TypeError(f"x must be float32 and w uint8 blocks, got {x.dtype} and {w.dtype}")
    if x.device.type != "cpu" or w.device.type != "cpu":
        raise ValueError("the gemv kernel runs on CPU tensors")
    M, K = x.shape
    N = w.shape[0]
    if w.shape[1] != row_bytes(qtype, K):
        raise ValueError(f"w rows of {w.shape[1]} bytes do not hold {K} {qtype} weights")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("x and w need contiguous columns")
    if bias is not None and (bias.shape != (N,) or bias.dtype != torch.float32 or not bias.is_contiguous()
                             or bias.device.type != "cpu"):
        raise ValueError(f"bias must be a contiguous float32 CPU (N,) = ({N},) tensor")
    if out is not None and (out.shape != (M, N) or out.dtype != torch.float32 or out.stride(1) != 1
                            or out.device.type != "cpu"):
        raise ValueError(f"out must be float32 ({M}, {N}) on CPU with contiguous columns")
    return M, N, K


def gemv(x: torch.Tensor, w: torch.Tensor, qtype: str, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) float32, w (N, K / 32 * bytes per block) uint8 blocks of `qtype`, bias (N,) or None
    -> (M, N) float32 = x @ W^T + bias (into `out` when given)."""
    M, N, K = _check(x, w, qtype, bias, out)
    out = torch.empty(M, N, dtype=torch.float32) if out is None else out
    if M and N:
        fn = _lib().pd_gemv_q4_1 if qtype == "Q4_1" else _lib().pd_gemv_q8_0
        fn(x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), None if bias is None else bias.data_ptr(),
           M, N, K, out.data_ptr(), out.stride(0), torch.get_num_threads())
    return out


def dequantize(w: torch.Tensor, qtype: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weights (N, K) that blocks w (N, row bytes) uint8 stand for, computed in `dtype`
    (float32: bit for bit the gguf package's values; float64: exact)."""
    row_bytes(qtype, BLOCK)  # a ValueError for other types
    N = w.shape[0]
    blocks = w.reshape(N, -1, TYPES[qtype])  # (N, nb, bytes)

    def half(at: int) -> torch.Tensor:  # (N, nb, 1) f16 field at byte `at` of each block
        return blocks[..., at:at + 2].contiguous().view(torch.float16).to(dtype)

    if qtype == "Q4_1":
        qs = blocks[..., 4:].to(torch.int32)  # (N, nb, 16)
        q = torch.cat([qs & 15, qs >> 4], dim=-1).to(dtype)  # (N, nb, 32): low nibbles first
        return (half(0) * q + half(2)).reshape(N, -1)
    q = blocks[..., 2:].contiguous().view(torch.int8).to(dtype)  # (N, nb, 32)
    return (half(0) * q).reshape(N, -1)


def reference(x: torch.Tensor, w: torch.Tensor, qtype: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product in float64: x (M, K), blocks w (N, row bytes) -> (M, N) float64."""
    y = x.double() @ dequantize(w, qtype, torch.float64).T  # (M, N)
    return y if bias is None else y + bias.double()


class GgufLinear:
    """y = x @ W^T + bias with W as Q4_1 or Q8_0 blocks: x (M, K) float32, M <= max_rows -> (M, N)."""

    def __init__(self, blocks: torch.Tensor, qtype: str, bias: torch.Tensor | None,
                 max_rows: int = MAX_ROWS):
        if qtype not in TYPES or blocks.dtype != torch.uint8 or blocks.dim() != 2 \
                or blocks.shape[1] % TYPES.get(qtype, 1):
            raise ValueError(f"GgufLinear takes uint8 (N, row bytes) blocks of {', '.join(TYPES)}, got "
                             f"{qtype!r} {blocks.dtype} {tuple(blocks.shape)}")
        self.weight, self.qtype = blocks.contiguous(), qtype
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.max_rows = max_rows
        self.out_features = blocks.shape[0]
        self.in_features = blocks.shape[1] // TYPES[qtype] * BLOCK

    @property
    def nbytes(self) -> int:
        """Bytes one full product reads from the weight."""
        return self.weight.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (M, K) -> (M, N)
        if x.stride(1) != 1:
            x = x.contiguous()
        return gemv(x, self.weight, self.qtype, self.bias)
