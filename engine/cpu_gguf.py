"""Projections of a few float32 rows by weights kept as a GGUF file's own Q4_1 / Q8_0 blocks.

A GGUF file stores each matrix row as blocks of 32 weights: Q4_1 in 20 bytes (f16 d, f16 m, 16
bytes of nibbles: low nibbles are elements 0..15, high nibbles 16..31; value d * q + m), Q8_0 in
34 (f16 d, 32 int8; value d * q). engine/csrc/gguf_gemv.c (built by engine.cpu_kernels) reads
those bytes (5.1x / 3.8x fewer than float32), `pack`ed sixteen rows at a time (the same bytes
moved so that a vector lane is a weight row: see the C file), widens each weight in registers to
exactly the float32 value the `gguf` package's dequantize gives, and sums in float32, so its
result is the float32 product up to summation order. `gemv` is the launcher (it checks dtypes,
shapes and strides, and packs the blocks it is given: the tests' way); `dequantize` is the same
widening in torch and `reference` the product in float64, for the tests. `GgufLinear` holds one
matrix's blocks, packed once (a block never spans rows, so a fused projection is its parts' rows
stacked) and serves x (M, K) for M up to `max_rows`, like engine.cpu_lowp.LowpLinear;
engine.weight_format builds them for `--weights gguf`.
With `act="q8"` the rows of x are first rounded to blocks of 32 int8 codes and one float32 scale
(llama.cpp's Q8_1) and engine/csrc/gguf_q8.c sums integer products (vpdpbusd / vpmaddubsw): two
float operations a block instead of eight to twelve, the product of the same weights with the
rounded x (it reads the blocks as the file has them, unpacked). `quantize_q8` gives those codes,
and `reference(..., act="q8")` the float64 product they stand for.
"""

from __future__ import annotations

import ctypes

import torch

from engine import cpu_kernels

BLOCK = 32  # weights per block
GROUP = 16  # rows packed together for the f32-activation kernel (one vector lane each)
TYPES = {"Q4_1": 20, "Q8_0": 34}  # GGML type name -> bytes per block
ACTS = {"f32": "gguf_gemv", "q8": "gguf_q8"}  # how x enters the sums -> its kernel library
# x rows up to which the kernels beat oneDNN on the float32 weights (5.6x the bytes): SmolLM2's
# matrices, one thread, 2026-12-02: 8 rows 40 ms (q8: 32) against ~50 for oneDNN, 16 rows 83 (64)
MAX_ROWS = 8


def available(act: str = "f32") -> bool:
    return cpu_kernels.load(ACTS[act]) is not None


def _lib(act: str = "f32"):
    return cpu_kernels.require(ACTS[act], f"GGUF block gemv kernels ({act} activations)")


def _kernel(qtype: str, act: str):
    """The C function for blocks of `qtype` against x as `act`."""
    if act not in ACTS:
        raise ValueError(f"activations {act!r}: choose from {', '.join(ACTS)}")
    name = "pd_gemv_q4_1" if qtype == "Q4_1" else "pd_gemv_q8_0"
    return getattr(_lib(act), name + ("_q8" if act == "q8" else ""))


def row_bytes(qtype: str, in_features: int) -> int:
    """Bytes of one row of `in_features` weights in `qtype` (a multiple of BLOCK weights)."""
    if qtype not in TYPES:
        raise ValueError(f"GGUF type {qtype!r} has no kernel here; supported: {', '.join(TYPES)}")
    if in_features % BLOCK:
        raise ValueError(f"{qtype} rows hold multiples of {BLOCK} weights, not {in_features}")
    return in_features // BLOCK * TYPES[qtype]


def pack(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """Blocks w (N, row bytes) uint8 -> the same bytes (ceil(N / 16) * 16, row bytes) in the f32
    kernel's layout: per group of 16 rows (the last one padded with zero blocks) and block column,
    the rows' d (16 f16), Q4_1's m (16 f16), then their codes with rows innermost (Q4_1: byte p of
    each row for p = 0..15; Q8_0: code k of each row for k = 0..31)."""
    N, rb = w.shape
    size = TYPES[qtype]
    nb, G = rb // size, -(-N // GROUP)
    blocks = w.reshape(N, nb, size)
    if N % GROUP:
        blocks = torch.cat([blocks, blocks.new_zeros(G * GROUP - N, nb, size)])
    blocks = blocks.view(G, GROUP, nb, size).permute(0, 2, 1, 3)  # (G, nb, 16 rows, block bytes)
    scales = 4 if qtype == "Q4_1" else 2
    parts = [blocks[..., at:at + 2].reshape(G, nb, 2 * GROUP) for at in range(0, scales, 2)]  # d (, m)
    codes = blocks[..., scales:].transpose(2, 3).reshape(G, nb, -1)  # (G, nb, codes x 16 rows)
    return torch.cat(parts + [codes], dim=-1).reshape(G * GROUP, rb).contiguous()


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
         out: torch.Tensor | None = None, act: str = "f32") -> torch.Tensor:
    """x (M, K) float32, w (N, K / 32 * bytes per block) uint8 blocks of `qtype`, bias (N,) or None
    -> (M, N) float32 = x @ W^T + bias (into `out` when given); act "q8": x rounded to int8 blocks."""
    M, N, K = _check(x, w, qtype, bias, out)
    fn = _kernel(qtype, act)
    out = torch.empty(M, N, dtype=torch.float32) if out is None else out
    ws = w.stride(0)
    if act == "f32" and M and N:
        w = pack(w, qtype)
        ws = GROUP * w.stride(0)
    if M and N and fn(x.data_ptr(), x.stride(0), w.data_ptr(), ws,
                      None if bias is None else bias.data_ptr(), M, N, K, out.data_ptr(), out.stride(0),
                      torch.get_num_threads()):
        raise MemoryError(f"no scratch memory for {M} x {K} int8 codes")
    return out


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float32 -> (codes (M, K) int8, scales (M, K / 32) float32), as the q8 kernel rounds
    x: scale = max |x| / 127 per block, code = x * (1 / scale) to the nearest, ties to even."""
    M, K = x.shape
    if x.dtype != torch.float32 or K % BLOCK or x.stride(1) != 1:
        raise ValueError("x must be float32 (M, K) with contiguous columns and K a multiple of 32")
    q, d, s = torch.empty(M, K, dtype=torch.int8), torch.empty(M, K // BLOCK), torch.empty(M, K // BLOCK)
    _lib("q8").pd_quantize_q8(x.data_ptr(), x.stride(0), M, K, q.data_ptr(), d.data_ptr(), s.data_ptr())
    return q, d


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


def reference(x: torch.Tensor, w: torch.Tensor, qtype: str, bias: torch.Tensor | None = None,
              act: str = "f32") -> torch.Tensor:
    """The same product in float64: x (M, K), blocks w (N, row bytes) -> (M, N) float64; act "q8":
    of x as its int8 codes times their scales."""
    if act == "q8":
        q, d = quantize_q8(x)
        x = (q.double().view(q.shape[0], -1, BLOCK) * d.double()[..., None]).view(q.shape)  # (M, K)
    y = x.double() @ dequantize(w, qtype, torch.float64).T  # (M, N)
    return y if bias is None else y + bias.double()


class GgufLinear:
    """y = x @ W^T + bias with W as Q4_1 or Q8_0 blocks: x (M, K) float32, M <= max_rows -> (M, N).
    act: "f32" (x as it is) or "q8" (x rounded to int8 blocks). The weight is checked once here,
    so a call checks only x (the decode step's hot path)."""

    def __init__(self, blocks: torch.Tensor, qtype: str, bias: torch.Tensor | None,
                 max_rows: int = MAX_ROWS, act: str = "f32"):
        if qtype not in TYPES or blocks.dtype != torch.uint8 or blocks.dim() != 2 \
                or blocks.shape[1] % TYPES.get(qtype, 1):
            raise ValueError(f"GgufLinear takes uint8 (N, row bytes) blocks of {', '.join(TYPES)}, got "
                             f"{qtype!r} {blocks.dtype} {tuple(blocks.shape)}")
        self.qtype, self.act, self.max_rows = qtype, act, max_rows
        self._group = GROUP if act == "f32" else 1  # rows the kernel reads together (f32: packed)
        self.out_features = blocks.shape[0]
        self.in_features = blocks.shape[1] // TYPES[qtype] * BLOCK
        self.bias = None if bias is None else bias.detach().float().contiguous()
        _check(torch.empty(0, self.in_features), blocks, qtype, self.bias, None)
        self._fn = _kernel(qtype, act)
        self.weight = pack(blocks, qtype) if self._group > 1 else blocks.contiguous()

    @property
    def weight(self) -> torch.Tensor:
        return self._weight

    @weight.setter
    def weight(self, blocks: torch.Tensor) -> None:
        """The blocks as the kernel reads them (packed for act f32), or a contiguous copy of them,
        e.g. moved into an engine.arena mapping."""
        rows = -(-self.out_features // self._group) * self._group
        shape = (rows, row_bytes(self.qtype, self.in_features))
        if blocks.dtype != torch.uint8 or blocks.shape != shape or not blocks.is_contiguous() \
                or blocks.device.type != "cpu":
            raise ValueError("GgufLinear weight blocks must keep their dtype, shape and contiguity on CPU")
        self._weight = blocks
        bias = None if self.bias is None else self.bias.data_ptr()
        stride = blocks.stride(0) * self._group  # packed: bytes per group of rows
        self._args = (blocks.data_ptr(), stride, bias)

    def c_gemv(self) -> tuple[int, int, int, int | None, int, int]:
        """(C function address, weight address, weight stride (f32: bytes per packed group of 16
        rows; q8: bytes per row), bias address or None, N, K) for engine.cpu_decode_layers."""
        fn = ctypes.cast(self._fn, ctypes.c_void_p).value
        return (fn, *self._args, self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        """Bytes one full product reads from the weight."""
        return self._weight.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (M, K) -> (M, N)
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.in_features \
                or x.device.type != "cpu":
            return gemv(x, self._weight, self.qtype, self.bias, act=self.act)  # raises the precise error
        if x.stride(1) != 1:
            x = x.contiguous()
        M, N = x.shape[0], self.out_features
        out = torch.empty(M, N)
        w, ws, b = self._args
        if M and self._fn(x.data_ptr(), x.stride(0), w, ws, b, M, N, self.in_features, out.data_ptr(), N,
                          torch.get_num_threads()):
            raise MemoryError(f"no scratch memory for {M} x {self.in_features} int8 codes")
        return out
