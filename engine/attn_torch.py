"""Reference attention backend in plain torch: scatter new K/V into their slots, then gather
every sequence's blocks into one padded contiguous copy and call scaled_dot_product_attention
once, with a mask for padding and for the causal offset of the cached prefix. It copies the
history every step (the cost the seed warns about), but it is obviously right: the Triton
kernels, which read blocks in place, are tested against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attn_metadata import AttentionMetadata


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key/value: (T, Hkv, D); k_cache/v_cache: (N, B, Hkv, D) strided views; slot_mapping: (T,)."""
    B = k_cache.shape[1]
    blocks, offs = slot_mapping // B, slot_mapping % B
    k_cache[blocks, offs] = key.to(k_cache.dtype)
    v_cache[blocks, offs] = value.to(v_cache.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: (T, Hq, D) -> (T, Hq, D); causal over each sequence's paged history.

    All sequences at once: gather every table's blocks into a padded (S, L, Hkv, D) copy, pad
    the queries to (S, Q, Hq, D), and mask keys past each sequence's length or causal position.
    """
    S, B = meta.num_seqs, k_cache.shape[1]
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    nb = -(-meta.max_seq_len // B)
    flat = meta.block_tables[:, :nb].reshape(-1).long()  # (S * nb,)
    L = nb * B
    k = k_cache.index_select(0, flat).view(S, L, Hkv, D)  # (S, L, Hkv, D); index_select beats [] here
    v = v_cache.index_select(0, flat).view(S, L, Hkv, D)
    Q = meta.max_query_len
    q_lens = torch.tensor(meta.query_lens_host, device=q.device)  # (S,)
    seq_lens = torch.tensor(meta.seq_lens_host, device=q.device)  # (S,)
    starts = meta.query_start_loc[:-1].long().to(q.device)  # (S,)
    i = torch.arange(Q, device=q.device)  # (Q,)
    q_valid = i[None, :] < q_lens[:, None]  # (S, Q)
    q_rows = (starts[:, None] + i[None, :]).clamp(max=T - 1)  # (S, Q) index into the packed q
    qp = q[q_rows]  # (S, Q, Hq, D)
    # query i of sequence s sits at absolute position seq_len - q_len + i and sees keys 0..that
    qpos = seq_lens[:, None] - q_lens[:, None] + i[None, :]  # (S, Q)
    mask = torch.arange(L, device=q.device)[None, None, :] <= qpos[:, :, None]  # (S, Q, L)
    o = F.scaled_dot_product_attention(  # grouped-query heads share K/V without a copy
        qp.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(),
        attn_mask=mask[:, None], scale=scale, enable_gqa=Hq != Hkv)  # (S, Hq, Q, D)
    return o.transpose(1, 2)[q_valid].to(q.dtype)  # (T, Hq, D)
