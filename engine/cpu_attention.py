"""CPU decode attention through a compiled C kernel that reads the paged pool in place.

`paged_decode(q, k_cache, v_cache, batch, scale)` attends one query per sequence over its own
blocks only (engine/csrc/paged_decode.c): no padding to the longest sequence, no history copy,
no per-slot mirror. `DecodeBatch` holds a step's block tables and lengths, checked once and
reused by every layer. The kernel is built and loaded by engine.cpu_kernels; `available` says
whether it is there (the torch backend keeps its torch paths otherwise). float32 on CPU only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import cpu_kernels
from engine.attn_metadata import int64_tensor


class KernelError(RuntimeError):
    """The kernel is not available, or ran out of scratch memory."""


def available() -> bool:
    return cpu_kernels.load("paged_decode") is not None


def supports_head_dim(head_dim: int) -> bool:
    """The kernel works in vectors of 16 floats and keeps up to 256 of them per query head."""
    return head_dim % 16 == 0 and 0 < head_dim <= 256


def applies(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """The kernel serves this attention: CPU, float32, a head size it takes, and it is built."""
    return device.type == "cpu" and dtype == torch.float32 and supports_head_dim(head_dim) and available()


@dataclass(frozen=True)
class DecodeBatch:
    """One step's decode sequences for the kernel, checked once (every layer reuses it)."""

    tables: torch.Tensor  # (n, W) int64 block ids, rows padded with the last real one
    lens: torch.Tensor    # (n,) int64 keys each sequence attends
    block_size: int
    max_block: int        # the largest block id named (the pool must hold it)

    @staticmethod
    def build(tables: list[list[int]], lens: list[int], block_size: int) -> DecodeBatch:
        """From host lists: sequence i attends keys 0..lens[i]-1 through tables[i]."""
        if len(tables) != len(lens):
            raise ValueError("one table per length")
        width = max((len(t) for t in tables), default=1)
        flat: list[int] = []
        for table, n in zip(tables, lens):
            if not 1 <= n <= len(table) * block_size:
                raise ValueError(f"length {n} outside 1..{len(table) * block_size} for {len(table)} blocks")
            if min(table) < 0:
                raise ValueError("negative block id")
            flat += table + [table[-1]] * (width - len(table))
        return DecodeBatch(int64_tensor(flat, torch.device("cpu")).view(len(tables), width),
                           int64_tensor(lens, torch.device("cpu")), block_size,
                           max((max(t) for t in tables), default=0))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch,
                 scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """q (n, Hq, D) float32, one query per sequence of `batch`; k_cache/v_cache (N, B, Hkv, D)
    float32 views with equal strides and contiguous (Hkv, D) rows -> out (n, Hq, D) (written into
    `out` when given, which must be contiguous)."""
    lib = cpu_kernels.load("paged_decode")
    if lib is None:
        raise KernelError("the CPU decode attention kernel is not available")
    n, Hq, D = q.shape
    N, B, Hkv, _ = k_cache.shape
    if q.dtype != torch.float32 or k_cache.dtype != torch.float32 or v_cache.dtype != torch.float32:
        raise TypeError("paged_decode takes float32 q and caches")
    if q.device.type != "cpu" or k_cache.device.type != "cpu" or v_cache.device.type != "cpu":
        raise ValueError("paged_decode runs on CPU tensors")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1 \
            or k_cache.stride(2) != D or q.shape[2] != k_cache.shape[3]:
        raise ValueError("k_cache and v_cache need one shape, equal strides and contiguous (Hkv, D) rows")
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads do not group over {Hkv} kv heads")
    if not supports_head_dim(D):
        raise ValueError(f"head size {D} is not a multiple of 16 up to 256")
    if batch.lens.shape != (n,) or batch.block_size != B or batch.max_block >= N:
        raise ValueError(f"the batch ({batch.lens.shape[0]} sequences, blocks of {batch.block_size}, block "
                         f"{batch.max_block}) does not fit q ({n} rows) and the pool ({N} x {B})")
    if q.stride(2) != 1 or q.stride(1) != D:
        q = q.contiguous()
    if out is None:
        out = torch.empty(n, Hq, D, dtype=torch.float32)
    elif out.shape != (n, Hq, D) or not out.is_contiguous() or out.dtype != torch.float32:
        raise ValueError("out must be a contiguous float32 (n, Hq, D) tensor")
    if n == 0:
        return out
    tables = batch.tables
    code = lib.pd_paged_decode_f32(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                   k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.data_ptr(),
                                   tables.stride(0), batch.lens.data_ptr(), n, Hq, Hkv, D, B, scale,
                                   torch.get_num_threads(), out.data_ptr())
    if code:
        raise KernelError("the kernel could not allocate its scratch memory" if code == 2 else
                          f"the kernel refused head size {D}")
    return out
