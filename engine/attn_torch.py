"""Attention in plain torch over the paged KV cache, with separate decode and prefill paths.

Decode (one query per sequence): on CPU in float32, when the workspace asks for it (the engine's
default), the compiled kernel of engine.cpu_attention reads each sequence's own blocks in place.
Otherwise, in the engine, each sequence's K/V are read where they lie in the persistent per-slot
decode mirror (engine.attn_mirror), one batched matmul pair over (slot, kv head), only the new
tokens written per step. Otherwise (ragged batches, standalone callers)
sequences of similar length form a group whose blocks (only each sequence's own, padded to the
group's longest with the null block) are gathered once per layer into a reused workspace, and
the queries attend with two batched matmuls and a softmax under a padding bias (for small GQA
shapes all heads at once as rows, a head mask hiding the other kv heads); either way no query
padding, and the cost follows the tokens attended within a bounded padding ratio, not batch x
longest context. Prefill (more than one query) is engine.attn_torch_prefill's, per sequence;
the gather buffers and the mirror live in the engine's engine.attn_workspace.Workspace. Decode
masks, indices and slot block/offset come from the step's `TorchPlan`, built on the first layer.
`forward` stores and attends; `store_kv` and `paged_attention` are the two halves (the Triton
tests' reference).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from engine import cpu_attention, cpu_fused
from engine.attn_metadata import (
    AttentionMetadata,
    DecodeGroup,
    TorchPlan,
    build_torch_plan,
    int64_tensor,
)
from engine.attn_mirror import MirrorStep
from engine.attn_torch_prefill import prefill
from engine.attn_workspace import Workspace, gather  # noqa: F401 (Workspace: the engine's import)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key/value: (T, Hkv, D); k_cache/v_cache: (N, B, Hkv, D) strided views; slot_mapping: (T,)."""
    B = k_cache.shape[1]
    _store(key, value, k_cache, v_cache, slot_mapping // B, slot_mapping % B)


def _store(key, value, k_cache, v_cache, blocks: torch.Tensor, offsets: torch.Tensor) -> None:
    if key.dtype == k_cache.dtype == torch.float32 and key.device.type == "cpu" and \
            key.stride() == value.stride() and cpu_fused.available():  # one pass, no index_put_ dispatch
        cpu_fused.store_kv(key, value, k_cache, v_cache, blocks, offsets)
        return
    k_cache.index_put_((blocks, offsets), key.to(k_cache.dtype))
    v_cache.index_put_((blocks, offsets), value.to(v_cache.dtype))


def _plan(meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor, layer: int | None) -> TorchPlan:
    plan = meta.torch_plan
    if plan is None or plan.decode and plan.decode[0].bias.dtype != q.dtype:
        _, B, Hkv, _ = k_cache.shape
        mirror = None
        decode = [s for s, n in enumerate(meta.query_lens_host) if n == 1]
        workspace = meta.workspace
        starts = list(itertools.accumulate(meta.query_lens_host, initial=0))
        kernel = None
        if decode and workspace is not None and workspace.kernel and \
                cpu_attention.applies(q.device, q.dtype, q.shape[2]):
            rows = [starts[s] for s in decode]
            batch = cpu_attention.DecodeBatch.build([meta.tables_host[s] for s in decode],
                                                    [meta.seq_lens_host[s] for s in decode], B)
            kernel = KernelStep(slice(rows[0], rows[-1] + 1) if rows[-1] - rows[0] + 1 == len(rows)
                                else int64_tensor(rows, q.device), batch)
        elif decode and layer is not None and workspace is not None and workspace.mirror is not None \
                and meta.seq_ids is not None:
            final = max(meta.final_lens[s] for s in decode) if meta.final_lens else 0
            mirror = workspace.mirror.plan(
                [meta.seq_ids[s] for s in decode], [starts[s] for s in decode],
                [meta.seq_lens_host[s] for s in decode], [meta.tables_host[s] for s in decode], final, B,
                Hkv, k_cache.shape[0] * B, q.dtype, q.device)
        plan = meta.torch_plan = build_torch_plan(meta, q.dtype, B, q.shape[1], Hkv,
                                                  mirror is None and kernel is None)
        plan.mirror, plan.kernel = mirror, kernel
        plan.decode_only = plan.decode_only or not plan.prefill and (
            mirror is not None and mirror.rows is None and mirror.num == q.shape[0]
            or kernel is not None and kernel.rows == slice(0, q.shape[0]))
    return plan


def decode_plan(meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor) -> TorchPlan:
    """The step's plan as the first layer builds it (engine.cpu_decode_layers reads its kernel
    batch and slots): q (T, Hq, D) gives the shape and dtype, k_cache (N, B, Hkv, D) the pool."""
    return _plan(meta, q, k_cache, 0)


@dataclass
class KernelStep:
    """The decode rows the compiled kernel serves this step (engine.cpu_attention)."""

    rows: slice | torch.Tensor  # their rows in the packed batch (a slice when consecutive)
    batch: cpu_attention.DecodeBatch


def forward(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
            layer: int | None = None, keep: list[int] | None = None) -> torch.Tensor:
    """Store the step's K/V (T, Hkv, D) into their slots, then attend: q (T, Hq, D) -> (T, Hq, D).
    layer: the model layer (the decode mirror keeps buffers per layer; None: no mirror).
    keep: the only rows whose output is wanted, ascending, each its sequence's last (None: all)
    -> (len(keep), Hq, D); a prefill sequence then attends for its last row or not at all."""
    plan = _plan(meta, q, k_cache, layer)
    _store(key, value, k_cache, v_cache, plan.slot_blocks, plan.slot_offsets)
    last_rows = None if keep is None else set(keep)
    if plan.kernel is not None:
        out = _kernel_decode(q, key, value, k_cache, v_cache, plan, scale, meta.workspace, last_rows)
        return _select(out, keep)
    if plan.mirror is None:
        return _select(_attend(q, key, value, k_cache, v_cache, plan, scale, meta.workspace, last_rows), keep)
    step: MirrorStep = plan.mirror
    keys, values = meta.workspace.mirror.prepare(layer, k_cache, v_cache, step)  # (S, Hkv, P, D) each
    rows = step.rows if step.rows is not None else slice(0, step.num)
    slots = step.slots
    keys[slots, :, step.positions] = key[rows].to(keys.dtype)  # the new tokens, in slot order
    values[slots, :, step.positions] = value[rows].to(values.dtype)
    o = _mirror_decode(q[rows], keys, values, step, scale)  # (num, Hq, D), slot order
    if plan.decode_only:
        return _select(o, keep)
    out = _attend(q, key, value, k_cache, v_cache, plan, scale, meta.workspace, last_rows)
    if step.rows is None:
        out[:step.num] = o
    else:
        out.index_copy_(0, step.rows, o)
    return _select(out, keep)


def _kernel_decode(q, key, value, k_cache, v_cache, plan: TorchPlan, scale: float, workspace: Workspace,
                   last_rows: set[int] | None) -> torch.Tensor:
    """The compiled kernel for the decode rows, the gather paths for the prefill ones -> (T, Hq, D)."""
    step: KernelStep = plan.kernel
    if plan.decode_only:
        return cpu_attention.paged_decode(q, k_cache, v_cache, step.batch, scale)
    out = _attend(q, key, value, k_cache, v_cache, plan, scale, workspace, last_rows)  # prefill rows
    if isinstance(step.rows, slice):  # a contiguous block of the contiguous output
        cpu_attention.paged_decode(q[step.rows], k_cache, v_cache, step.batch, scale, out=out[step.rows])
    else:
        out.index_copy_(0, step.rows, cpu_attention.paged_decode(q.index_select(0, step.rows), k_cache,
                                                                 v_cache, step.batch, scale))
    return out


def _select(out: torch.Tensor, keep: list[int] | None) -> torch.Tensor:
    """out (T, Hq, D) -> rows `keep` (R, Hq, D) (all of them when keep is None)."""
    return out if keep is None else out.index_select(0, int64_tensor(keep, out.device))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: (T, Hq, D) -> (T, Hq, D); causal over each sequence's paged history (K/V stored already)."""
    return _attend(q, None, None, k_cache, v_cache, _plan(meta, q, k_cache, None), scale,
                   meta.workspace)


def _attend(q, key, value, k_cache, v_cache, plan: TorchPlan, scale: float, workspace: Workspace | None,
            last_rows: set[int] | None = None) -> torch.Tensor:
    """The gather paths: decode groups and prefill sequences (rows the mirror serves are left unset).
    last_rows: when given, a prefill sequence attends only if its last row is one of them, and
    only for that row (the other rows are left unset)."""
    if plan.decode_only:
        return _decode(q, k_cache, v_cache, plan.decode[0], plan.heads_as_rows, scale, workspace)
    out = torch.empty_like(q)  # (T, Hq, D)
    for group in plan.decode:
        o = _decode(q[group.rows], k_cache, v_cache, group, plan.heads_as_rows, scale,
                    workspace)  # (n, Hq, D)
        if isinstance(group.rows, slice):
            out[group.rows] = o
        else:
            out.index_copy_(0, group.rows, o)
    for seq in plan.prefill:
        if last_rows is None or seq.end - 1 in last_rows:
            prefill(q, key, value, k_cache, v_cache, seq, scale, workspace, out, last_rows is not None)
    return out


def _mirror_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step: MirrorStep,
                   scale: float) -> torch.Tensor:
    """q: (num, Hq, D) in slot order; keys/values: the mirror (S, Hkv, P, D) -> (num, Hq, D)."""
    num, Hq, D = q.shape
    Hkv, L = keys.shape[1], step.length
    k = keys[:num, :, :L].reshape(num * Hkv, L, D)  # (num Hkv, L, D), a view: no copy
    v = values[:num, :, :L].reshape(num * Hkv, L, D)  # (num Hkv, L, D)
    queries = q.reshape(num * Hkv, Hq // Hkv, D)  # (num Hkv, G, D): the G query heads of each kv head
    scores = torch.baddbmm(step.bias, queries, k.transpose(1, 2), alpha=scale)  # (num Hkv, G, L)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.bmm(probs, v).view(num, Hq, D)  # (num Hkv, G, D) -> (num, Hq, D)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup,
            heads_as_rows: bool, scale: float, workspace: Workspace | None) -> torch.Tensor:
    """q: (n, Hq, D), one query per sequence of the group -> (n, Hq, D)."""
    n, Hq, D = q.shape
    _, B, Hkv, _ = k_cache.shape
    L = group.width * B
    k = gather(k_cache, group.blocks, workspace, "key")  # (n * width, B, Hkv, D)
    v = gather(v_cache, group.blocks, workspace, "value")  # (n * width, B, Hkv, D)
    if heads_as_rows:  # keys ordered (token, head); the bias hides the other kv heads
        keys = k.view(n, L * Hkv, D).transpose(1, 2)  # (n, D, L Hkv)
        scores = torch.baddbmm(group.bias, q, keys, alpha=scale)  # (n, Hq, L Hkv)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        return torch.bmm(probs, v.view(n, L * Hkv, D))  # (n, Hq, D)
    k, v = k.view(n, L, Hkv, D), v.view(n, L, Hkv, D)  # (n, L, Hkv, D)
    G = Hq // Hkv
    outs = []
    for h in range(Hkv):  # the G query heads of kv head h are G query rows against its keys
        scores = torch.baddbmm(group.bias, q[:, h * G:(h + 1) * G], k[:, :, h].transpose(1, 2),
                               alpha=scale)  # (n, G, L)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)  # (n, G, L)
        outs.append(torch.bmm(probs, v[:, :, h]))  # (n, G, D)
    return torch.cat(outs, dim=1)  # (n, Hq, D)
