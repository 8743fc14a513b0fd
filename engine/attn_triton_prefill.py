"""Triton paged prefill attention: ragged query lengths, causal over a cached prefix, K/V read in
place through the block table. Query i of sequence s sits at absolute position
seq_len - q_len + i and sees keys 0..that position. Programs tile queries (BLOCK_M rows of one
sequence and one query head) and walk keys in BLOCK_N tiles; each key's cache block comes from
the table, so BLOCK_N is independent of the cache block size (1, 16, 32, ... all give the same
tiling and therefore bit-identical results). Inputs are validated by engine.attn_triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attn_metadata import AttentionMetadata


@triton.jit
def _paged_prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_lens_ptr, qstart_ptr,
                          stride_qt, stride_qh, stride_qd,
                          stride_kn, stride_kb, stride_kh, stride_kd,
                          stride_vn, stride_vb, stride_vh, stride_vd,
                          stride_ot, stride_oh, stride_od, stride_bt,
                          qk_scale,
                          GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          DOT_PRECISION: tl.constexpr):
    """Program (query tile m, seq s, q head h): rows m*BLOCK_M.. of sequence s's new tokens."""
    m = tl.program_id(0)
    s = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    q_start = tl.load(qstart_ptr + s)
    q_len = tl.load(qstart_ptr + s + 1) - q_start
    if m * BLOCK_M >= q_len:  # this sequence has fewer query tiles than the longest one
        return
    seq_len = tl.load(seq_lens_ptr + s)
    ctx = seq_len - q_len  # tokens already cached before this step
    kvh = h // GROUP

    offs_m = m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    m_mask = offs_m < q_len
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :] * stride_qd,
                mask=m_mask[:, None], other=0.0)  # (BLOCK_M, D)
    q_pos = ctx + offs_m  # absolute positions of the rows

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # running max, log2 domain
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    table_row = tables_ptr + s * stride_bt
    hi = tl.minimum(seq_len, ctx + (m + 1) * BLOCK_M)  # last row of the tile sees keys < hi
    for k0 in range(0, hi, BLOCK_N):
        pos = k0 + offs_n
        valid = pos < hi
        blk = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        off = pos % BLOCK_SIZE
        k = tl.load(k_ptr + blk[None, :] * stride_kn + off[None, :] * stride_kb + kvh * stride_kh
                    + offs_d[:, None] * stride_kd, mask=valid[None, :], other=0.0)  # (D, BLOCK_N)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        causal = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        qk = tl.where(causal, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + blk[:, None] * stride_vn + off[:, None] * stride_vb + kvh * stride_vh
                    + offs_d[None, :] * stride_vd, mask=valid[:, None], other=0.0)  # (BLOCK_N, D)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


def launch_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                   meta: AttentionMetadata, qk_scale: float, block_m: int, block_n: int, num_warps: int = 4,
                   num_stages: int = 2) -> None:
    """Grid (query tiles of the longest sequence, sequences, query heads); q/out (T, Hq, D),
    caches (N, B, Hkv, D) with any strides; qk_scale already includes log2(e). num_warps and
    num_stages: Triton's launch options (bench.kernels_sweep tunes them)."""
    T, Hq, D = q.shape
    _, B, Hkv, _ = k_cache.shape
    grid = (triton.cdiv(meta.max_query_len, block_m), meta.num_seqs, Hq)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), meta.block_tables.stride(0),
        qk_scale, GROUP=Hq // Hkv, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=D, BLOCK_SIZE=B,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages)
