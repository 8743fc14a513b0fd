"""Per-engine scratch for the torch attention backend: `Workspace` keeps the K/V gather buffers
(reused by every layer and step, grown on demand) and the decode mirror; `gather` reads a
sequence's cache blocks into them. Shared by the decode paths (engine.attn_torch) and the prefill
path (engine.attn_torch_prefill)."""

from __future__ import annotations

import math

import torch

from engine.attn_mirror import DecodeMirror


class Workspace:
    """Per-engine state of the torch backend: scratch buffers for the K/V gathers, reused by every
    layer and step and grown on demand (a fresh multi-megabyte tensor per gather costs page faults
    that, on CPU, rival the attention arithmetic itself), and the decode mirror. Not thread-safe:
    one per engine."""

    def __init__(self, mirror: bool = True, kernel: bool = False) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.mirror = DecodeMirror() if mirror else None
        self.kernel = kernel  # CPU float32 decode reads the pool in place (engine.cpu_attention)

    def take(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A contiguous tensor of `shape` with `like`'s dtype and device (contents undefined)."""
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._buffers[name] = torch.empty(numel + numel // 4, dtype=like.dtype, device=like.device)
        return buf[:numel].view(shape)  # (*shape)


def gather(cache: torch.Tensor, blocks: torch.Tensor, workspace: Workspace | None,
            name: str) -> torch.Tensor:
    """cache (N, B, Hkv, D) rows `blocks` -> (n, B, Hkv, D), into the workspace when there is one."""
    if workspace is None:
        return cache.index_select(0, blocks)
    out = workspace.take(name, (blocks.shape[0], *cache.shape[1:]), cache)
    return torch.index_select(cache, 0, blocks, out=out)
