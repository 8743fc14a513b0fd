"""Triton attention backend on the paged KV cache: the same `store_kv` / `paged_attention` pair as
engine.attn_torch, but the kernels walk each sequence's block table and read K/V blocks in place
(no gather copy). `_store_kv_kernel` scatters new tokens into their slots; `_paged_decode_kernel`
is flash-decoding (one query per sequence, all query heads of a KV head in one tile, online
softmax, the context optionally split across programs and merged by `_decode_reduce_kernel`);
prefill lives in engine.attn_triton_prefill. The launchers check shapes, strides, dtypes and
devices first (engine.attn_triton_checks) and raise ValueError on anything the kernels would
silently get wrong. On CPU the
kernels run under TRITON_INTERPRET=1 (set before triton is imported), for tests only.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.attn_metadata import AttentionMetadata
from engine.attn_triton_checks import DTYPES, check_attention, check_cache, check_device, interpreting
from engine.attn_triton_prefill import launch_prefill

_LOG2E = 1.4426950408889634
# Decode splits: aim for this many programs per SM before splitting a context; a split gets at least
# _MIN_SPLIT_KEYS keys (below it the merge costs more than the parallelism brings).
_PROGRAMS_PER_SM, _MIN_SPLIT_KEYS, _MAX_SPLITS = 2, 256, 64


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, k_ptr, v_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                     stride_cn, stride_cb, stride_ch, stride_cd,
                     stride_dn, stride_db, stride_dh, stride_dd,
                     NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr):
    """One program per token: copy its (Hkv, D) key and value into slot_mapping[t]."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < NUM_HEADS)[:, None]
    k = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
                mask=mask)  # (BLOCK_H, D)
    v = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
                mask=mask)
    tl.store(k_ptr + blk * stride_cn + off * stride_cb + offs_h[:, None] * stride_ch
             + offs_d[None, :] * stride_cd, k.to(k_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + blk * stride_dn + off * stride_db + offs_h[:, None] * stride_dh
             + offs_d[None, :] * stride_dd, v.to(v_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, tables_ptr, seq_lens_ptr,
                         stride_qt, stride_qh, stride_qd,
                         stride_kn, stride_kb, stride_kh, stride_kd,
                         stride_vn, stride_vb, stride_vh, stride_vd,
                         stride_os, stride_oh, stride_ox, stride_od,
                         stride_ls, stride_lh, stride_bt,
                         qk_scale, split_len,
                         GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, WRITE_LSE: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """Program (seq s, kv head, split x): the GROUP query heads of that kv head attend over keys
    [x * split_len, min((x + 1) * split_len, seq_len)). Writes the normalised partial output at
    out[s, head, x] and, when WRITE_LSE, its log2-sum-exp at lse[s, head, x]."""
    s = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    x = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + s)
    start = x * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    q = tl.load(q_ptr + s * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=g_mask[:, None], other=0.0)  # (BLOCK_G, D)

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)  # running max, log2 domain
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)          # running sum of exp2
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    table_row = tables_ptr + s * stride_bt
    for k0 in range(start, end, BLOCK_N):
        pos = k0 + offs_n
        valid = pos < end
        blk = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        off = pos % BLOCK_SIZE
        k = tl.load(k_ptr + blk[None, :] * stride_kn + off[None, :] * stride_kb + kvh * stride_kh
                    + offs_d[:, None] * stride_kd, mask=valid[None, :], other=0.0)  # (D, BLOCK_N)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_G, BLOCK_N)
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + blk[:, None] * stride_vn + off[:, None] * stride_vb + kvh * stride_vh
                    + offs_d[None, :] * stride_vd, mask=valid[:, None], other=0.0)  # (BLOCK_N, D)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(out_ptr + s * stride_os + heads[:, None] * stride_oh + x * stride_ox
             + offs_d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    if WRITE_LSE:
        lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + s * stride_ls + heads * stride_lh + x, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(part_ptr, lse_ptr, out_ptr,
                          stride_ps, stride_ph, stride_px, stride_pd,
                          stride_ls, stride_lh, stride_os, stride_oh, stride_od,
                          num_splits, BLOCK_X: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Program (seq s, q head): merge the split partials by their log2-sum-exp weights."""
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_x = tl.arange(0, BLOCK_X)
    offs_d = tl.arange(0, HEAD_DIM)
    x_mask = offs_x < num_splits
    lse = tl.load(lse_ptr + s * stride_ls + h * stride_lh + offs_x, mask=x_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m)  # (BLOCK_X,), 0 for empty splits
    part = tl.load(part_ptr + s * stride_ps + h * stride_ph + offs_x[:, None] * stride_px
                   + offs_d[None, :] * stride_pd, mask=x_mask[:, None], other=0.0)  # (BLOCK_X, D)
    denom = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + s * stride_os + h * stride_oh + offs_d * stride_od, out.to(out_ptr.dtype.element_ty))


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key/value: (T, Hkv, D); k_cache/v_cache: (N, B, Hkv, D) strided views; slot_mapping: (T,)
    int physical slots (block * B + offset). A negative slot marks a padding token and is skipped."""
    check_cache(k_cache, v_cache)
    check_device(key, value, k_cache, v_cache, slot_mapping)
    T = key.shape[0]
    if key.dim() != 3 or key.shape != value.shape or tuple(key.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(f"key/value must be (T, Hkv, D) = (T, {k_cache.shape[2]}, {k_cache.shape[3]}); "
                         f"got {tuple(key.shape)} and {tuple(value.shape)}")
    if key.dtype not in DTYPES or value.dtype not in DTYPES:
        raise ValueError(f"key/value dtype must be one of {DTYPES}; got {key.dtype}, {value.dtype}")
    if slot_mapping.shape != (T,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64 of shape ({T},); got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    if T == 0:
        return
    _, B, H, D = k_cache.shape
    _store_kv_kernel[(T,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_HEADS=H, BLOCK_H=triton.next_power_of_2(H), HEAD_DIM=D, BLOCK_SIZE=B)


@functools.lru_cache(maxsize=8)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def decode_block_n(head_dim: int) -> int:
    """Keys per decode tile. 128 for head_dim <= 64 (bench.kernels_sweep, H200, 64 seqs x 2048, D 64:
    0.128 ms against 0.156 with 64); 64 otherwise (best or within 1% for D 128)."""
    return 16 if interpreting() else 128 if head_dim <= 64 else 64


def _decode_splits(device: torch.device, num_seqs: int, kv_heads: int, max_seq_len: int) -> int:
    """Split the context only when seqs x kv heads cannot fill the GPU on their own."""
    if device.type != "cuda":
        return 1
    target = _PROGRAMS_PER_SM * _num_sms(device.index if device.index is not None else 0)
    base = num_seqs * kv_heads
    if base >= target:
        return 1
    return max(1, min(triton.cdiv(target, base), triton.cdiv(max_seq_len, _MIN_SPLIT_KEYS), _MAX_SPLITS))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, num_splits: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """Decode (one query per sequence): q (S, Hq, D) -> (S, Hq, D). `num_splits`/`block_n` override
    the heuristics (tests use them to cover the split-and-merge path on CPU)."""
    check_attention(q, k_cache, v_cache, meta)
    S, Hq, D = q.shape
    if meta.max_query_len != 1 or S != meta.num_seqs:
        raise ValueError("paged_decode needs exactly one query token per sequence")
    _, B, Hkv, _ = k_cache.shape
    group = Hq // Hkv
    out = torch.empty((S, Hq, D), dtype=q.dtype, device=q.device)
    if S == 0:
        return out
    bn = block_n or decode_block_n(D)
    if bn < 16 or bn & (bn - 1):
        raise ValueError(f"block_n must be a power of two >= 16; got {bn}")
    splits = num_splits or _decode_splits(q.device, S, Hkv, meta.max_seq_len)
    # Splits start on key-tile boundaries, so every split walks the same tiles as the unsplit kernel.
    split_len = triton.cdiv(triton.cdiv(meta.max_seq_len, splits), bn) * bn
    splits = max(1, triton.cdiv(meta.max_seq_len, split_len))
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    common = dict(GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=bn, HEAD_DIM=D,
                  BLOCK_SIZE=B, DOT_PRECISION=dot_precision, num_warps=4)
    if splits == 1:
        view = out.unsqueeze(2)  # (S, Hq, 1, D)
        _paged_decode_kernel[(S, Hkv, 1)](
            q, k_cache, v_cache, view, view, meta.block_tables, meta.seq_lens,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *view.stride(), 0, 0,
            meta.block_tables.stride(0), scale * _LOG2E, split_len, WRITE_LSE=False, **common)
        return out
    part = torch.empty((S, Hq, splits, D), dtype=torch.float32, device=q.device)
    lse = torch.empty((S, Hq, splits), dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(S, Hkv, splits)](
        q, k_cache, v_cache, part, lse, meta.block_tables, meta.seq_lens,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *part.stride(), lse.stride(0), lse.stride(1),
        meta.block_tables.stride(0), scale * _LOG2E, split_len, WRITE_LSE=True, **common)
    _decode_reduce_kernel[(S, Hq)](
        part, lse, out, *part.stride(), lse.stride(0), lse.stride(1), *out.stride(),
        splits, BLOCK_X=triton.next_power_of_2(splits), HEAD_DIM=D, num_warps=4)
    return out


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float, block_m: int | None = None, block_n: int | None = None, **launch):
    """Ragged causal prefill over each sequence's cached prefix: q (T, Hq, D) -> (T, Hq, D). The new
    tokens' K/V must already be in the cache (store_kv first). launch: num_warps/num_stages."""
    check_attention(q, k_cache, v_cache, meta)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        return out
    bm = block_m or (16 if interpreting() else 64)
    bn = block_n or (16 if interpreting() else 64)
    for name, val in (("block_m", bm), ("block_n", bn)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"{name} must be a power of two >= 16; got {val}")
    launch_prefill(q, k_cache, v_cache, out, meta, scale * _LOG2E, bm, bn, **launch)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: (T, Hq, D) -> (T, Hq, D); causal over each sequence's paged history (decode kernel when
    every sequence has one new token, the prefill kernel otherwise)."""
    if meta.max_query_len == 1:
        return paged_decode(q, k_cache, v_cache, meta, scale)
    return paged_prefill(q, k_cache, v_cache, meta, scale)
