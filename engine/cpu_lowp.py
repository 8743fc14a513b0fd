"""Projections of a few float32 rows by weights stored in bf16 or int8, through a compiled kernel.

A decode step multiplies 1..32 rows by every weight, so its time is the weight bytes it reads.
engine/csrc/lowp_gemv.c (built by engine.cpu_kernels) reads W (N, K) as bf16 (2 bytes) or int8
with one float32 scale per output row (1 byte), widens each element to float32 in registers and
sums in float32: activations, accumulation and results stay float32. `gemv_bf16`/`gemv_int8` are
the launchers (they check dtypes, shapes and strides); `reference` is the same product in float64
torch, for the tests. `LowpLinear` holds one quantized weight and serves x (M, K) for M up to
`max_rows`; more rows (prefill) go to the float32 path on the dequantized weight, which the
caller keeps (engine.weight_format), so both paths compute the same function up to summation
order. Without a compiler `available()` is False and nothing here is used.
"""

from __future__ import annotations

import ctypes

import torch

from engine import cpu_kernels

# Rows up to which the kernel runs; above it oneDNN on the float32 copy is faster (compute bound:
# measured on SmolLM2 shapes, 2 threads: at 8 rows they tie on the logits, oneDNN wins elsewhere).
MAX_ROWS = 4


def available() -> bool:
    return cpu_kernels.load("lowp_gemv") is not None


def _lib():
    return cpu_kernels.require("lowp_gemv", "low-precision CPU gemv kernels")


def _check(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None,
           bias: torch.Tensor | None, out: torch.Tensor | None) -> tuple[int, int, int]:
    """(M, N, K) after checking every tensor the kernel reads or writes."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x (M, K) and w (N, K) expected, got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != torch.float32 or w.dtype != dtype:
        raise TypeError(f"x must be float32 and w {dtype}, got {x.dtype} and {w.dtype}")
    if x.device.type != "cpu" or w.device.type != "cpu":
        raise ValueError("the gemv kernel runs on CPU tensors")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("x and w need contiguous columns")
    M, K = x.shape
    N = w.shape[0]
    for name, t in (("scale", scale), ("bias", bias)):
        if t is not None and (t.shape != (N,) or t.dtype != torch.float32 or not t.is_contiguous()
                              or t.device.type != "cpu"):
            raise ValueError(f"{name} must be a contiguous float32 CPU (N,) = ({N},) tensor")
    if out is not None and (out.shape != (M, N) or out.dtype != torch.float32 or out.stride(1) != 1):
        raise ValueError(f"out must be float32 ({M}, {N}) with contiguous columns")
    return M, N, K


def gemv_bf16(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) float32, w (N, K) bfloat16, bias (N,) or None -> (M, N) float32 = x @ w^T + bias."""
    M, N, K = _check(x, w, torch.bfloat16, None, bias, out)
    out = torch.empty(M, N, dtype=torch.float32) if out is None else out
    if M and N:
        _lib().pd_gemv_bf16(x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0),
                            None if bias is None else bias.data_ptr(), M, N, K, out.data_ptr(), out.stride(0),
                            torch.get_num_threads())
    return out


def gemv_int8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) float32, w (N, K) int8, scale (N,) float32 -> (M, N) = (x @ w^T) * scale + bias."""
    if scale is None:
        raise ValueError("int8 weights need their (N,) scale")
    M, N, K = _check(x, w, torch.int8, scale, bias, out)
    out = torch.empty(M, N, dtype=torch.float32) if out is None else out
    if M and N:
        _lib().pd_gemv_int8(x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), scale.data_ptr(),
                            None if bias is None else bias.data_ptr(), M, N, K, out.data_ptr(), out.stride(0),
                            torch.get_num_threads())
    return out


def reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product in float64: x (M, K), w (N, K) of any dtype -> (M, N) float64."""
    y = x.double() @ w.double().T  # (M, N)
    if scale is not None:
        y = y * scale.double()
    return y if bias is None else y + bias.double()


def quantize_bf16(weight: torch.Tensor) -> tuple[torch.Tensor, None]:
    """weight (N, K) float32 -> (bf16 (N, K) rounded to nearest even, no scale)."""
    return weight.detach().to(torch.bfloat16).contiguous(), None


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) float32 -> (int8 (N, K), scale (N,) float32): symmetric, per output row,
    scale = max|row| / 127, values rounded to nearest (an all-zero row gets scale 1)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0  # (N,)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)  # (N, K)
    return q.contiguous(), scale.contiguous()


def dequantize(stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The float32 weight (N, K) the stored form stands for (exact: no rounding on the way back)."""
    w = stored.float()
    return w if scale is None else w * scale[:, None]


class LowpLinear:
    """y = x @ W^T + bias with W stored in bf16 or int8: x (M, K) float32, M <= max_rows -> (M, N)."""

    def __init__(self, stored: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
                 max_rows: int = MAX_ROWS):
        int8 = stored.dtype == torch.int8
        if stored.dtype not in (torch.bfloat16, torch.int8) or int8 != (scale is not None):
            raise ValueError("LowpLinear takes bf16 weights, or int8 weights with their scale")
        self.weight, self.scale = stored, scale
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.max_rows = max_rows
        self.out_features = stored.shape[0]

    def c_gemv(self) -> tuple[int, int, int, int | None, int, int] | None:
        """(C function address, weight address, row stride, bias address or None, N, K) for
        engine.cpu_decode_layers: bf16 only (int8's kernel takes a scale too), None without it."""
        if self.scale is not None or not self.weight.is_contiguous() or not available():
            return None
        fn = ctypes.cast(_lib().pd_gemv_bf16, ctypes.c_void_p).value
        bias = None if self.bias is None else self.bias.data_ptr()
        w = self.weight
        return fn, w.data_ptr(), w.stride(0), bias, self.out_features, w.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes one full product reads from the weight (and scale)."""
        n = self.weight.numel() * self.weight.element_size()
        return n + (0 if self.scale is None else self.scale.numel() * 4)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (M, K) -> (M, N)
        if x.stride(1) != 1:
            x = x.contiguous()
        if self.scale is None:
            return gemv_bf16(x, self.weight, self.bias)
        return gemv_int8(x, self.weight, self.scale, self.bias)
