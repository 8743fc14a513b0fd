"""Attention in plain torch over the paged KV cache, with separate decode and prefill paths.

Decode (one query per sequence): sequences of similar length form a group; the group's blocks
(only each sequence's own, padded to the group's longest with the null block) are gathered once
per layer, and each KV head's query rows attend with two batched matmuls and a softmax under a
padding bias (no grouped-query expansion, no query padding). The cost follows the tokens
attended, within the grouping ratio, not batch x longest context. Prefill (more than one query):
per sequence, causal scaled_dot_product_attention; when nothing was cached the keys are the
step's own K/V (no pool read), otherwise the sequence's blocks with a lower-right causal mask
(prefix-cache hit, or a later chunk of a chunked prefill). Masks, gather indices and slot
block/offset come from the step's `TorchPlan`, built on the first layer. `forward` stores and
attends; `store_kv` and `paged_attention` are the separate halves (the Triton tests' reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attn_metadata import AttentionMetadata, DecodeGroup, PrefillSequence, TorchPlan, build_torch_plan


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key/value: (T, Hkv, D); k_cache/v_cache: (N, B, Hkv, D) strided views; slot_mapping: (T,)."""
    B = k_cache.shape[1]
    _store(key, value, k_cache, v_cache, slot_mapping // B, slot_mapping % B)


def _store(key, value, k_cache, v_cache, blocks: torch.Tensor, offsets: torch.Tensor) -> None:
    k_cache.index_put_((blocks, offsets), key.to(k_cache.dtype))
    v_cache.index_put_((blocks, offsets), value.to(v_cache.dtype))


def _plan(meta: AttentionMetadata, dtype: torch.dtype, block_size: int) -> TorchPlan:
    plan = meta.torch_plan
    if plan is None or plan.decode and plan.decode[0].bias.dtype != dtype:
        plan = meta.torch_plan = build_torch_plan(meta, dtype, block_size)
    return plan


def forward(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Store the step's K/V (T, Hkv, D) into their slots, then attend: q (T, Hq, D) -> (T, Hq, D)."""
    plan = _plan(meta, q.dtype, k_cache.shape[1])
    _store(key, value, k_cache, v_cache, plan.slot_blocks, plan.slot_offsets)
    return _attend(q, key, value, k_cache, v_cache, plan, scale)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: (T, Hq, D) -> (T, Hq, D); causal over each sequence's paged history (K/V stored already)."""
    return _attend(q, None, None, k_cache, v_cache, _plan(meta, q.dtype, k_cache.shape[1]), scale)


def _attend(q, key, value, k_cache, v_cache, plan: TorchPlan, scale: float) -> torch.Tensor:
    if plan.decode_only:
        return _decode(q, k_cache, v_cache, plan.decode[0], scale)
    out = torch.empty_like(q)  # (T, Hq, D)
    for group in plan.decode:
        o = _decode(q[group.rows], k_cache, v_cache, group, scale)  # (n, Hq, D)
        if isinstance(group.rows, slice):
            out[group.rows] = o
        else:
            out.index_copy_(0, group.rows, o)
    for seq in plan.prefill:
        out[seq.start:seq.end] = _prefill(q, key, value, k_cache, v_cache, seq, scale)
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup,
            scale: float) -> torch.Tensor:
    """q: (n, Hq, D), one query per sequence of the group -> (n, Hq, D)."""
    n, Hq, D = q.shape
    _, B, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    L = group.width * B
    k = k_cache.index_select(0, group.blocks).view(n, L, Hkv, D)  # (n, L, Hkv, D)
    v = v_cache.index_select(0, group.blocks).view(n, L, Hkv, D)  # (n, L, Hkv, D)
    outs = []
    for h in range(Hkv):  # the G query heads of kv head h are G query rows against its keys
        scores = torch.baddbmm(group.bias, q[:, h * G:(h + 1) * G], k[:, :, h].transpose(1, 2),
                               alpha=scale)  # (n, G, L)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)  # (n, G, L)
        outs.append(torch.bmm(probs, v[:, :, h]))  # (n, G, D)
    return outs[0] if Hkv == 1 else torch.cat(outs, dim=1)  # (n, Hq, D)


def _prefill(q, key, value, k_cache, v_cache, seq: PrefillSequence, scale: float) -> torch.Tensor:
    """Causal attention of one sequence's new tokens -> (Q, Hq, D)."""
    Hq, Hkv = q.shape[1], k_cache.shape[2]
    qs = q[seq.start:seq.end].transpose(0, 1).unsqueeze(0)  # (1, Hq, Q, D)
    if seq.mask is None and key is not None:  # nothing cached: the step's own K/V are every key
        ks = key[seq.start:seq.end].transpose(0, 1).unsqueeze(0)  # (1, Hkv, Q, D)
        vs = value[seq.start:seq.end].transpose(0, 1).unsqueeze(0)  # (1, Hkv, Q, D)
    else:
        D = k_cache.shape[3]
        ks = k_cache.index_select(0, seq.blocks).view(-1, Hkv, D)[:seq.seq_len]  # (L, Hkv, D)
        vs = v_cache.index_select(0, seq.blocks).view(-1, Hkv, D)[:seq.seq_len]  # (L, Hkv, D)
        ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)  # (1, Hkv, L, D)
    o = F.scaled_dot_product_attention(qs, ks.to(qs.dtype), vs.to(qs.dtype), attn_mask=seq.mask,
                                       is_causal=seq.mask is None, scale=scale,
                                       enable_gqa=Hq != Hkv)  # (1, Hq, Q, D)
    return o[0].transpose(0, 1)  # (Q, Hq, D)
