"""Batch description that every attention backend reads for one forward step.

A step runs S sequences with T new tokens in total, packed back to back (varlen, no padding).
Sequence s contributes tokens query_start_loc[s]:query_start_loc[s+1]; those are its last
q_len positions, so query i of sequence s sits at absolute position seq_lens[s] - q_len + i and
attends causally to positions 0..that position through its block table (lower-right aligned).
Decode is the case q_len == 1; a prefill chunk, or a prefill after a prefix-cache hit, has
q_len < seq_len. `build` computes every per-token index (slots, positions) once per step;
`TorchPlan` adds what the torch backend needs (decode groups with their gather indices and
masks, prefill sequences with their blocks, slot block/offset), built on the first layer and
reused by the rest. Padded block-table entries point at the pool's null block when one is given.
"""

from __future__ import annotations

import array
import functools
import itertools
from dataclasses import dataclass

import torch

# Decode sequences are grouped by length so that padding (to a group's longest member) stays
# bounded: going down the lengths, a new group starts at a sequence with less than this fraction
# of the group's blocks, if the padding it and the shorter ones would otherwise carry exceeds
# the fixed cost of a group, which is about what attending this many key slots costs.
DECODE_GROUP_RATIO = 0.5
DECODE_GROUP_COST_SLOTS = 4096
# Up to this many (query head x kv head) pairs, decode scores every query head against all kv
# heads' keys in one batched matmul and masks the other heads out: Hkv times the arithmetic,
# which is small next to the memory traffic at such sizes, for 1/Hkv of the calls. Past it, one
# matmul pair per kv head.
HEADS_AS_ROWS_LIMIT = 32


def int64_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """(len,) int64 from host ints, through array.array (about 3x faster than torch.tensor(list))."""
    if not values:
        return torch.zeros(0, dtype=torch.int64, device=device)
    tensor = torch.frombuffer(array.array("q", values), dtype=torch.int64)
    return tensor if device.type == "cpu" else tensor.to(device)


class AttentionMetadata:
    """One step's batch. Host lists are exact and always there; the device tensors a kernel
    needs are built from them on first use (the torch backend never asks for the padded table).

    slot_mapping: (T,) int64 physical slot (block * B + offset) of each new token.
    positions: (T,) int64 absolute position of each new token.
    block_tables: (S, max_blocks) int32, rows padded with the null block (0 when none is given).
    seq_lens: (S,) int32 context length after this step (cached + new).
    query_start_loc: (S + 1,) int32 cumulative new-token offsets, [0] == 0.
    """

    def __init__(self, tables_host: list[list[int]], seq_lens_host: list[int], query_lens_host: list[int],
                 block_size: int, device: torch.device, null_block: int | None, positions: list[int],
                 slots: list[int]):
        self.tables_host = tables_host          # unpadded block ids per sequence
        self.seq_lens_host = seq_lens_host
        self.query_lens_host = query_lens_host
        self.block_size = block_size
        self.device = device
        self.null_block = null_block            # the pool's zeroed padding block
        self.max_query_len = max(query_lens_host)
        self.max_seq_len = max(seq_lens_host)
        self.positions = int64_tensor(positions, device)  # (T,)
        self.slot_mapping = int64_tensor(slots, device)  # (T,)
        self.torch_plan: TorchPlan | None = None  # engine.attn_torch's per-step plan, built on first use
        self.workspace = None                     # engine.attn_workspace.Workspace the engine reuses, if any
        self.seq_ids: list | None = None          # the engine's sequence ids (lets the decode mirror
                                                  # follow a sequence from step to step)
        self.final_lens: list[int] | None = None  # longest each sequence can get (sizes the mirror)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @functools.cached_property
    def block_tables(self) -> torch.Tensor:
        width = max(len(t) for t in self.tables_host)
        pad = 0 if self.null_block is None else self.null_block
        return torch.tensor([t + [pad] * (width - len(t)) for t in self.tables_host], dtype=torch.int32,
                            device=self.device)  # (S, W)

    @functools.cached_property
    def seq_lens(self) -> torch.Tensor:
        return torch.tensor(self.seq_lens_host, dtype=torch.int32, device=self.device)  # (S,)

    @functools.cached_property
    def query_start_loc(self) -> torch.Tensor:
        return torch.tensor(list(itertools.accumulate(self.query_lens_host, initial=0)), dtype=torch.int32,
                            device=self.device)  # (S + 1,)

    @staticmethod
    def build(block_tables: list[list[int]], seq_lens: list[int], query_lens: list[int],
              block_size: int, device: torch.device | str = "cpu",
              null_block: int | None = None) -> AttentionMetadata:
        """From per-sequence host lists: tables, context lengths after the step, new tokens.
        null_block: the block id padded table entries name (the engine passes its pool's)."""
        if not (len(block_tables) == len(seq_lens) == len(query_lens)):
            raise ValueError("block_tables, seq_lens and query_lens must have one entry per sequence")
        B = block_size
        positions: list[int] = []
        slots: list[int] = []
        for table, n, q in zip(block_tables, seq_lens, query_lens):
            if not 1 <= q <= n or len(table) * B < n:
                raise ValueError(f"bad sequence: q_len {q}, seq_len {n}, {len(table)} blocks of {B}")
            if q == 1:
                positions.append(n - 1)
                slots.append(table[(n - 1) // B] * B + (n - 1) % B)
                continue
            positions += range(n - q, n)
            for j in range((n - q) // B, (n - 1) // B + 1):  # a run of slots per block touched
                base = table[j] * B - j * B
                slots += range(base + max(n - q, j * B), base + min(n, (j + 1) * B))
        return AttentionMetadata([list(t) for t in block_tables], list(seq_lens), list(query_lens), B,
                                 torch.device(device), null_block, positions, slots)


@dataclass
class DecodeGroup:
    """One-query sequences of similar length, attended together padded to the longest."""

    rows: slice | torch.Tensor  # their rows in the packed batch (a slice when consecutive)
    blocks: torch.Tensor        # (n * width,) int64 block ids, each sequence padded to `width`
    width: int                  # blocks per sequence in this group
    bias: torch.Tensor          # 0 for a visible key, -inf past the sequence's end (and, heads as
                                # rows, for other kv heads): (n, Hq, width * B * Hkv) heads as
                                # rows, else (n, 1, width * B)


@dataclass
class PrefillSequence:
    """A sequence with more than one new token: causal attention, lower-right aligned."""

    start: int                  # its first row in the packed batch
    end: int                    # one past its last row
    seq_len: int                # keys it attends (cached + new)
    blocks: torch.Tensor        # (nb,) int64 blocks holding keys 0..seq_len-1
    context: int                # keys cached before this step (seq_len - new tokens); the
                                # backend masks lower-right causally from it


@dataclass
class TorchPlan:
    """Everything the torch backend derives from the metadata, once per step."""

    slot_blocks: torch.Tensor   # (T,) int64 block of each new token's slot
    slot_offsets: torch.Tensor  # (T,) int64 offset inside that block
    decode: list[DecodeGroup]
    prefill: list[PrefillSequence]
    decode_only: bool           # one group covering rows 0..T-1 in order: no output scatter
    heads_as_rows: bool         # decode scores all heads in one matmul (see HEADS_AS_ROWS_LIMIT)
    mirror: object = None       # engine.attn_mirror.MirrorStep when decode reads the mirror instead
    kernel: object = None       # engine.attn_torch.KernelStep when the compiled CPU kernel serves decode


def build_torch_plan(meta: AttentionMetadata, dtype: torch.dtype, block_size: int, num_heads: int,
                     num_kv_heads: int, decode_groups: bool = True) -> TorchPlan:
    """The torch backend's per-step plan (the bias is in `dtype`, the attention's dtype).
    decode_groups: False when the decode mirror serves the one-query sequences."""
    device = meta.slot_mapping.device
    B = block_size
    tables = meta.tables_host
    starts = [0]
    for q in meta.query_lens_host:
        starts.append(starts[-1] + q)
    decode_seqs = [s for s, q in enumerate(meta.query_lens_host) if q == 1] if decode_groups else []
    heads = (num_heads, num_kv_heads) if num_heads * num_kv_heads <= HEADS_AS_ROWS_LIMIT else None
    groups = _decode_groups(decode_seqs, starts, tables, meta.seq_lens_host, B, meta.null_block, heads,
                            dtype, device)
    prefill = []
    for s, q in enumerate(meta.query_lens_host):
        if q == 1:
            continue
        n = meta.seq_lens_host[s]
        blocks = int64_tensor(tables[s][:-(-n // B)], device)
        prefill.append(PrefillSequence(starts[s], starts[s + 1], n, blocks, n - q))
    T = starts[-1]
    decode_only = not prefill and len(groups) == 1 and groups[0].rows == slice(0, T)
    slots = meta.slot_mapping
    return TorchPlan(slots // B, slots % B, groups, prefill, decode_only, heads is not None)


def _decode_groups(seqs: list[int], starts: list[int], tables: list[list[int]], seq_lens: list[int],
                   B: int, null_block: int | None, heads: tuple[int, int] | None, dtype: torch.dtype,
                   device) -> list[DecodeGroup]:
    """Group one-query sequences by length; `starts[s]` is the row of sequence s; heads: (Hq, Hkv)
    when heads are scored as rows."""
    by_len = sorted(seqs, key=lambda s: -seq_lens[s])
    members: list[list[int]] = []
    width = 0
    for i, s in enumerate(by_len):
        nb = -(-seq_lens[s] // B)
        if not members or nb < DECODE_GROUP_RATIO * width and \
                (width - nb) * B * (len(by_len) - i) > DECODE_GROUP_COST_SLOTS:
            members.append([])
            width = nb
        members[-1].append(s)
    if heads is not None and members:
        Hq, Hkv = heads
        other = torch.arange(Hq, device=device)[:, None, None] // (Hq // Hkv) != \
            torch.arange(Hkv, device=device)[None, None, :]  # (Hq, 1, Hkv): key head is not the query's
        head_bias = torch.zeros(other.shape, dtype=dtype, device=device).masked_fill_(other, float("-inf"))
    groups = []
    for group in members:
        group.sort()
        widths = [-(-seq_lens[s] // B) for s in group]
        width = max(widths)
        flat: list[int] = []
        for s, nb in zip(group, widths):
            flat += tables[s][:nb]
            if nb < width:  # masked either way; the null block keeps padding off live blocks
                flat += [tables[s][nb - 1] if null_block is None else null_block] * (width - nb)
        lens = int64_tensor([seq_lens[s] for s in group], device)  # (n,)
        if heads is None:
            past = torch.arange(width * B, device=device) >= lens[:, None]  # (n, L)
            bias = torch.where(past, float("-inf"), 0.0).to(dtype)[:, None, :]  # (n, 1, L)
        else:  # keys ordered (token, head): key j is token j // Hkv of kv head j % Hkv
            past = torch.arange(width * B * Hkv, device=device) // Hkv >= lens[:, None]  # (n, L Hkv)
            heads_pattern = head_bias.expand(Hq, width * B, Hkv).reshape(Hq, width * B * Hkv)  # (Hq, L Hkv)
            bias = torch.where(past, float("-inf"), 0.0).to(dtype)[:, None, :] + heads_pattern
            # bias: (n, Hq, L Hkv)
        rows_host = [starts[s] for s in group]
        first, last = rows_host[0], rows_host[-1]
        rows = slice(first, last + 1) if last - first + 1 == len(group) else \
            int64_tensor(rows_host, device)
        groups.append(DecodeGroup(rows, int64_tensor(flat, device), width, bias))
    return groups
