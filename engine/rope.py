"""Rotary position embeddings (RoPE) in the Hugging Face "rotate half" convention.

`RotaryEmbedding(config)` holds the inverse frequencies and a cos/sin table per (device, dtype),
grown by doubling to the largest position seen (never sized by the model's maximum context up
front). `RotaryEmbedding.tables(positions, dtype)` looks a step's rows up once; `apply_rotary`
rotates queries and keys together with them (one call per layer on the fused q/k view).
Scaling variants: 'default', 'linear' (positions divided by `factor`) and Llama 3.1's 'llama3'
(low frequencies divided by `factor`, a smooth blend in between). Others are refused by
engine.model_config with a message naming the rope type.
"""

from __future__ import annotations

import math

import torch

from engine.model_config import SUPPORTED_ROPE_TYPES, ModelConfig, UnsupportedModelError


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
    """cos/sin tables for absolute positions; shared by every layer of a model.

    A plain object, not a module buffer, on purpose: `model.to(bfloat16)` must not round the
    inverse frequencies. They stay float32; the angles are computed in float32 and the tables
    are cast to the model dtype once (transformers casts them per call to the same values).
    """

    def __init__(self, config: ModelConfig):
        self._inv_cpu = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling_dict)
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, positions: torch.Tensor, dtype: torch.dtype,
               max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (T,) int -> cos (T, D) and sign-folded sin (T, D) in `dtype`: the first half
        of `sin` is negated, so rotate_half(x) * sin == swap_halves(x) * folded_sin exactly.
        max_position: the largest position, when the caller knows it (saves a device sync)."""
        key = (positions.device, dtype)
        cos, sin = self._tables.get(key, (None, None))
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else 0
        need = max_position + 1
        if cos is None or cos.shape[0] < need:
            length = max(need, 256, 0 if cos is None else 2 * cos.shape[0])  # grow by doubling
            cos, sin = self._tables[key] = self._build(length, positions.device, dtype)
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def _build(self, length: int, device: torch.device,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self._inv_cpu.to(device)  # (D/2,) float32
        freqs = torch.arange(length, device=device).float()[:, None] * inv[None, :]  # (P, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
        half = inv.shape[0]
        sin = emb.sin()
        sin[:, :half] = -sin[:, :half]
        return emb.cos().to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, H, D); cos and sign-folded sin: (T, 1, D) in x's dtype (`tables`' rows, unsqueezed
    once per step) -> (T, H, D).

    Equals transformers' x * cos + rotate_half(x) * sin, rounding included: the only
    difference is where the minus sign sits, and negation is exact.
    """
    swapped = x.roll(x.shape[-1] // 2, -1)  # (T, H, D): the halves swapped
    return (x * cos).add_(swapped.mul_(sin))
