"""Argument checks of the Triton attention launchers (engine.attn_triton): shapes, strides,
dtypes and devices the kernels would otherwise get silently wrong raise ValueError here. Also
whether Triton runs under its CPU interpreter (TRITON_INTERPRET=1, tests only).
"""

from __future__ import annotations

import os

import torch

from engine.attn_metadata import AttentionMetadata

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be (N, B, Hkv, D); got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in DTYPES:
        raise ValueError(f"caches must share one dtype of {DTYPES}; got {k_cache.dtype}, {v_cache.dtype}")
    d = k_cache.shape[3]
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two in [16, 256] for the Triton kernels; got {d}")


def check_device(*tensors: torch.Tensor) -> None:
    dev = tensors[0].device
    for t in tensors:
        if t.device != dev:
            raise ValueError(f"all tensors must be on one device; got {dev} and {t.device}")
    if dev.type != "cuda" and not interpreting():
        raise ValueError(f"the Triton attention backend needs CUDA tensors (got {dev}); "
                         "set TRITON_INTERPRET=1 before importing triton to run it on CPU")


def check_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata) -> None:
    check_cache(k_cache, v_cache)
    check_device(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    if q.dim() != 3 or q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q must be (T, Hq, {k_cache.shape[3]}); got {tuple(q.shape)}")
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} must match the cache dtype {k_cache.dtype}")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k_cache.shape[2]})")
    if q.dtype == torch.bfloat16 and interpreting():
        raise ValueError("bfloat16 attention is not supported under TRITON_INTERPRET (numpy has no bf16 "
                         "matmul); use float16/float32 on CPU or run on CUDA")
    S = meta.num_seqs
    if meta.block_tables.dim() != 2 or meta.block_tables.shape[0] != S:
        raise ValueError(f"block_tables must be (S={S}, max_blocks); got {tuple(meta.block_tables.shape)}")
    if meta.block_tables.dtype != torch.int32 or meta.seq_lens.dtype != torch.int32 \
            or meta.query_start_loc.dtype != torch.int32:
        raise ValueError("block_tables, seq_lens and query_start_loc must be int32")
    if meta.seq_lens.shape != (S,) or meta.query_start_loc.shape != (S + 1,):
        raise ValueError(f"seq_lens must be ({S},) and query_start_loc ({S + 1},)")
    if q.shape[0] != sum(meta.query_lens_host):
        raise ValueError(f"q has {q.shape[0]} tokens but the metadata describes {sum(meta.query_lens_host)}")
    if meta.max_seq_len > meta.block_tables.shape[1] * k_cache.shape[1]:
        raise ValueError(f"max_seq_len {meta.max_seq_len} exceeds the block table's "
                         f"{meta.block_tables.shape[1]} blocks of {k_cache.shape[1]}")
