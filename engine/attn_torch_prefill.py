"""Prefill attention in plain torch (more than one query per sequence): per sequence, causal
scaled_dot_product_attention in blocks of queries, each against the keys up to its last query.
When nothing was cached the keys are the step's own K/V (no pool read); otherwise the sequence's
blocks (a prefix-cache hit, or a later chunk of a chunked prefill), masked lower-right causally by
views of one cached band. engine.attn_torch calls it for each prefill sequence of a step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attn_metadata import PrefillSequence
from engine.attn_workspace import Workspace, gather

# Prefill attends in blocks of this many queries, each against the keys up to its last query
# only: torch's CPU flash attention computes every key of a key block (up to 512 keys) for every
# query, masked or causal alike, so one call per chunk also pays for the hidden upper triangle
# (blocks take 11% off the prefill attention of the long bench preset's chunks, 19% off a fresh
# 256-token chunk's, their extra calls included).
PREFILL_QUERY_BLOCK = 64
_bands: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # (dtype, device) -> causal band


def band(first: int, rows: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(rows, first + rows) additive causal mask, 0 where key j is visible to the query at position
    first + i (j <= first + i), else -inf: a view of a cached band, grown on demand."""
    band = _bands.get((dtype, device))
    width = -1 if band is None else band.shape[1] - PREFILL_QUERY_BLOCK
    if width < first:
        width = max(first, 2 * width, 1024)
        cols = torch.arange(width + PREFILL_QUERY_BLOCK, device=device)  # (W + b,)
        rows_at = width + torch.arange(PREFILL_QUERY_BLOCK, device=device)  # (b,)
        hidden = cols[None, :] > rows_at[:, None]  # (b, W + b)
        band = _bands[(dtype, device)] = torch.zeros(hidden.shape, dtype=dtype,
                                                     device=device).masked_fill_(hidden, float("-inf"))
    return band[:rows, width - first:width + rows]  # (rows, first + rows), row stride W + b


def prefill(q, key, value, k_cache, v_cache, seq: PrefillSequence, scale: float,
             workspace: Workspace | None, out: torch.Tensor, last_only: bool = False) -> None:
    """Causal attention of one sequence's new tokens into out[seq.start:seq.end] (Q, Hq, D), a
    block of PREFILL_QUERY_BLOCK queries at a time against only the keys up to its last query.
    last_only: only its last query (out[seq.end - 1])."""
    Hq, Hkv = q.shape[1], k_cache.shape[2]
    qs = q[seq.start:seq.end].transpose(0, 1).unsqueeze(0)  # (1, Hq, Q, D)
    if seq.context == 0 and key is not None:  # nothing cached: the step's own K/V are every key
        ks = key[seq.start:seq.end].transpose(0, 1).unsqueeze(0)  # (1, Hkv, Q, D)
        vs = value[seq.start:seq.end].transpose(0, 1).unsqueeze(0)  # (1, Hkv, Q, D)
    else:
        D = k_cache.shape[3]
        ks = gather(k_cache, seq.blocks, workspace, "key").view(-1, Hkv, D)[:seq.seq_len]  # (L, Hkv, D)
        vs = gather(v_cache, seq.blocks, workspace, "value").view(-1, Hkv, D)[:seq.seq_len]  # (L, Hkv, D)
        ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)  # (1, Hkv, L, D)
    ks, vs = ks.to(qs.dtype), vs.to(qs.dtype)
    Q = seq.end - seq.start
    for first in range(Q - 1 if last_only else 0, Q, PREFILL_QUERY_BLOCK):
        last = min(Q, first + PREFILL_QUERY_BLOCK)  # rows first..last-1 of the sequence
        keys = seq.context + last  # keys up to the block's last query
        causal = last - first > 1 and seq.context + first == 0  # a fresh prompt's first block
        mask = None if causal or last - first == 1 else \
            band(seq.context + first, last - first, qs.dtype, qs.device)  # one query sees every key
        o = F.scaled_dot_product_attention(qs[:, :, first:last], ks[:, :, :keys], vs[:, :, :keys],
                                           attn_mask=mask, is_causal=causal, scale=scale,
                                           enable_gqa=Hq != Hkv)  # (1, Hq, last - first, D)
        out[seq.start + first:seq.start + last] = o[0].transpose(0, 1)  # (last - first, Hq, D)
