"""Reference attention backend in plain torch: scatter new K/V into their slots, then for each
sequence gather its blocks into a contiguous (seq_len, H, D) copy and call
scaled_dot_product_attention with a causal mask offset by the cached prefix. Slow (it copies the
history every step) but obviously right: the Triton kernels are tested against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attn_metadata import AttentionMetadata


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key/value: (T, Hkv, D); k_cache/v_cache: (N, B, Hkv, D) strided views; slot_mapping: (T,)."""
    N, B = k_cache.shape[0], k_cache.shape[1]
    blocks, offs = slot_mapping // B, slot_mapping % B
    k_cache[blocks, offs] = key.to(k_cache.dtype)
    v_cache[blocks, offs] = value.to(v_cache.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: (T, Hq, D) -> (T, Hq, D); causal over each sequence's paged history."""
    B = k_cache.shape[1]
    Hq, Hkv = q.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    start = 0
    for s, (n, ql) in enumerate(zip(meta.seq_lens_host, meta.query_lens_host)):
        nb = -(-n // B)
        table = meta.block_tables[s, :nb].long()
        k = k_cache[table].reshape(nb * B, Hkv, -1)[:n]  # (n, Hkv, D)
        v = v_cache[table].reshape(nb * B, Hkv, -1)[:n]
        qs = q[start:start + ql]  # (ql, Hq, D)
        if Hq != Hkv:
            k = k.repeat_interleave(Hq // Hkv, dim=1)  # (n, Hq, D)
            v = v.repeat_interleave(Hq // Hkv, dim=1)
        # query i sits at absolute position n - ql + i and sees keys 0..n - ql + i
        qpos = torch.arange(n - ql, n, device=q.device)[:, None]
        mask = torch.arange(n, device=q.device)[None, :] <= qpos  # (ql, n)
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
            attn_mask=mask, scale=scale)  # (Hq, ql, D)
        out[start:start + ql] = o.transpose(0, 1).to(q.dtype)
        start += ql
    return out
