"""Rotary position embeddings (RoPE) in the Hugging Face "rotate half" convention.

`RotaryEmbedding(config)` holds the inverse frequencies; calling it with absolute positions (T,)
gives cos/sin tables (T, head_dim) in float32, computed per step from the positions (so no table
sized by the model's maximum context is kept). `apply_rotary` rotates queries or keys with them.
Scaling variants: 'default', 'linear' (positions divided by `factor`) and Llama 3.1's 'llama3'
(low frequencies divided by `factor`, a smooth blend in between). Others are refused by
engine.config with a message naming the rope type.
"""

from __future__ import annotations

import math

import torch

from engine.config import SUPPORTED_ROPE_TYPES, ModelConfig, UnsupportedModelError


def inverse_frequencies(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """(head_dim // 2,) float32 inverse frequencies after the configured scaling."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, blended, scaled)
    raise UnsupportedModelError(f"rope_type {kind!r} is unsupported; "
                                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


class RotaryEmbedding:
    """cos/sin for absolute positions; shared by every layer of a model.

    A plain object, not a module buffer, on purpose: `model.to(bfloat16)` must not round the
    inverse frequencies. They stay float32, one copy per device, made on first use.
    """

    def __init__(self, config: ModelConfig):
        self._inv_cpu = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling_dict)
        self._inv: dict[torch.device, torch.Tensor] = {}

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (T,) int -> cos, sin: (T, D) float32."""
        inv = self._inv.get(positions.device)
        if inv is None:
            inv = self._inv[positions.device] = self._inv_cpu.to(positions.device)  # (D/2,) float32
        freqs = positions.float()[:, None] * inv[None, :]  # (T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, H, D) in any dtype; cos/sin: (T, D) float32 -> (T, H, D) in x's dtype.

    As in transformers, the tables are cast to x's dtype before the multiply.
    """
    cos = cos.to(x.dtype)[:, None, :]  # (T, 1, D)
    sin = sin.to(x.dtype)[:, None, :]  # (T, 1, D)
    return x * cos + _rotate_half(x) * sin
