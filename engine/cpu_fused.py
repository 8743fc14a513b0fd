"""The elementwise steps of a float32 decoder layer on CPU, one compiled pass each.

engine/csrc/fused.c (built by engine.cpu_kernels) replaces, per layer, RMSNorm (a composite of
about six torch ops) and its residual add, the rotary embedding (four ops), SiLU(gate) * up (two
ops over a strided half) and the two indexed stores of new K/V into the pool: at decode batch
sizes each torch op costs more in dispatch than in arithmetic. The rotary and SwiGLU round
exactly as the torch ops they replace (no fused multiply-add); RMSNorm sums its squares in its
own fixed order, so it differs from torch's by float32 rounding only. Every function checks
dtype, shape and strides, then calls through ctypes; the model uses them where `available()`
and the weights are float32 on CPU (`LlamaModel.use_cpu_fused`).
"""

from __future__ import annotations

import torch

from engine import cpu_kernels


def available() -> bool:
    return cpu_kernels.load("fused") is not None


def _lib():
    return cpu_kernels.require("fused", "fused CPU kernels")


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


def _is_f32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, H) -> (T, H) contiguous: RMSNorm(x) * weight; with `residual` (T, H), residual += x
    in place first and the result is RMSNorm(residual) * weight."""
    T, H = x.shape
    _require(_is_f32_cpu(x, weight) and x.stride(1) == 1 and weight.shape == (H,) and weight.is_contiguous(),
             "rms_norm takes float32 CPU rows (T, H) with contiguous columns and a (H,) weight")
    if residual is not None:
        _require(_is_f32_cpu(residual) and residual.shape == x.shape and residual.stride(1) == 1,
                 "the residual must be a float32 CPU (T, H) with contiguous columns")
    out = torch.empty(T, H, dtype=torch.float32)
    _lib().pd_rms_norm_f32(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                           0 if residual is None else residual.stride(0), weight.data_ptr(), T, H, eps,
                           out.data_ptr())
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (T, H, D) in place by cos and sign-folded sin rows (T, D) or (T, 1, D)
    (engine.rope's tables): x * cos + swap_halves(x) * sin. Returns x."""
    T, H, D = x.shape
    _require(_is_f32_cpu(x, cos, sin) and x.stride(2) == 1 and x.stride(1) == D and D % 2 == 0 and D <= 512,
             "rotary_ takes float32 CPU (T, H, D) with contiguous heads, D even and at most 512")
    cos, sin = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)  # (T, D) views
    _require(cos.shape == sin.shape == (T, D) and cos.stride() == sin.stride() and cos.stride(1) == 1,
             "cos and sin must be (T, D) rows with one stride")
    _lib().pd_rotary_f32(x.data_ptr(), T, H, x.stride(0), D, cos.data_ptr(), sin.data_ptr(), cos.stride(0))
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (T, 2I), gate then up -> silu(gate) * up (T, I) contiguous."""
    T, width = gate_up.shape
    _require(_is_f32_cpu(gate_up) and gate_up.stride(1) == 1 and width % 2 == 0,
             "silu_mul takes float32 CPU (T, 2I) rows with contiguous columns")
    out = torch.empty(T, width // 2, dtype=torch.float32)
    _lib().pd_silu_mul_f32(gate_up.data_ptr(), T, width // 2, gate_up.stride(0), out.data_ptr())
    return out


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             blocks: torch.Tensor, offsets: torch.Tensor) -> None:
    """key/value (T, Hkv, D) into k_cache/v_cache (N, B, Hkv, D) at (blocks[t], offsets[t]), both
    (T,) int64. Key and value rows share one stride (views of one qkv row), as do the caches."""
    T, Hkv, D = key.shape
    _require(_is_f32_cpu(key, value, k_cache, v_cache) and value.shape == key.shape
             and key.stride() == value.stride() and key.stride(2) == 1 and key.stride(1) == D,
             "store_kv takes float32 CPU key and value (T, Hkv, D) with one stride and contiguous heads")
    N, B = k_cache.shape[:2]
    _require(k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
             and k_cache.shape[2:] == (Hkv, D) and k_cache.stride(3) == 1 and k_cache.stride(2) == D,
             "the caches must be (N, B, Hkv, D) with one stride and contiguous (Hkv, D) slots")
    _require(blocks.dtype == offsets.dtype == torch.int64 and blocks.shape == offsets.shape == (T,)
             and blocks.is_contiguous() and offsets.is_contiguous(), "blocks, offsets: (T,) contiguous int64")
    if T == 0:
        return
    code = _lib().pd_store_kv_f32(key.data_ptr(), value.data_ptr(), key.stride(0), T, Hkv * D,
                                  k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
                                  k_cache.stride(1), N, B, blocks.data_ptr(), offsets.data_ptr())
    _require(code == 0, f"a slot is outside the pool ({N} blocks of {B})")
