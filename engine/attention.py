"""Attention backend selection: `torch` (reference) or `triton` (paged kernels).

Both expose the same two kernels, `store_kv(key, value, k_cache, v_cache, slot_mapping)` and
`paged_attention(q, k_cache, v_cache, meta, scale)`, and the model calls `forward(q, key, value,
k_cache, v_cache, meta, scale, layer, keep)`, which stores every row's K/V, then attends and
returns the rows in `keep` (all when None). The torch backend's own `forward` also skips reading
back K/V a fresh prefill already holds, and attends only for the kept rows. Auto-selection takes
Triton on CUDA and torch on CPU; PDSERVE_ATTENTION=torch|triton (or the engine's `attention_backend` config
field) forces one. A forced Triton backend on CPU needs TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    store_kv: Callable
    paged_attention: Callable
    forward: Callable  # (q, key, value, k_cache, v_cache, meta, scale, layer, keep) -> (T or R, Hq, D)


def _store_then_attend(store_kv: Callable, paged_attention: Callable) -> Callable:
    def forward(q, key, value, k_cache, v_cache, meta, scale, layer=None, keep=None):
        store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta, scale)  # (T, Hq, D)
        return out if keep is None else out[torch.tensor(keep, dtype=torch.int64, device=out.device)]
    return forward


def get_backend(name: str | None = None, device: torch.device | str = "cpu") -> AttentionBackend:
    """Resolve 'auto'/None, 'torch' or 'triton' to a backend for `device`."""
    name = name or os.environ.get("PDSERVE_ATTENTION", "auto")
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    if name == "torch":
        from engine import attn_torch as mod
    elif name == "triton":
        from engine import attn_triton as mod  # type: ignore[no-redef]
    else:
        raise ValueError(f"unknown attention backend {name!r}; expected auto, torch or triton")
    forward = getattr(mod, "forward", None) or _store_then_attend(mod.store_kv, mod.paged_attention)
    return AttentionBackend(name, mod.store_kv, mod.paged_attention, forward)
