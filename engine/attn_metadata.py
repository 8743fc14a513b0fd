"""Batch description that every attention backend reads for one forward step.

A step runs S sequences with T new tokens in total, packed back to back (varlen, no padding).
Sequence s contributes tokens query_start_loc[s]:query_start_loc[s+1]; those are its last
q_len positions, so query i of sequence s sits at absolute position seq_lens[s] - q_len + i and
attends causally to positions 0..that position through its block table (lower-right aligned).
Decode is the case q_len == 1; a prefill chunk, or a prefill after a prefix-cache hit, has
q_len < seq_len. `build` computes every per-token index (slots, positions) once per step;
`TorchPlan` adds what the torch backend needs (decode groups with their gather indices and
masks, per-sequence prefill masks, slot block/offset), built on the first layer and reused by
the rest. Padded block-table entries point at the pool's null block when one is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Decode sequences are grouped by length so that a group's padding (to its longest member) is
# bounded: a sequence joins a group while it has at least this fraction of the group's blocks.
DECODE_GROUP_RATIO = 0.5


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor     # (T,) int64: physical slot (block * B + offset) of each new token
    block_tables: torch.Tensor     # (S, max_blocks) int32, rows padded with the null block
    seq_lens: torch.Tensor         # (S,) int32: context length after this step (cached + new)
    query_start_loc: torch.Tensor  # (S + 1,) int32: cumulative new-token offsets, [0] == 0
    max_query_len: int
    max_seq_len: int
    # Host copies (python ints) so the torch reference never syncs with the device.
    seq_lens_host: list[int]
    query_lens_host: list[int]
    positions: torch.Tensor | None = None   # (T,) int64 absolute position of each new token
    block_size: int = 0
    null_block: int | None = None           # the pool's zeroed padding block (None: pad with 0)
    tables_host: list[list[int]] = field(default_factory=list)  # unpadded block ids per sequence
    torch_plan: TorchPlan | None = None     # engine.attn_torch's per-step plan, built on first use

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @staticmethod
    def build(block_tables: list[list[int]], seq_lens: list[int], query_lens: list[int],
              block_size: int, device: torch.device | str = "cpu",
              null_block: int | None = None) -> AttentionMetadata:
        """From per-sequence host lists: tables, context lengths after the step, new tokens.
        null_block: the block id padded table entries name (the engine passes its pool's)."""
        if not (len(block_tables) == len(seq_lens) == len(query_lens)):
            raise ValueError("block_tables, seq_lens and query_lens must have one entry per sequence")
        for table, n, q in zip(block_tables, seq_lens, query_lens):
            if not 1 <= q <= n or len(table) * block_size < n:
                raise ValueError(f"bad sequence: q_len {q}, seq_len {n}, {len(table)} blocks of {block_size}")
        S, T = len(seq_lens), sum(query_lens)
        width = max(len(t) for t in block_tables)
        pad = 0 if null_block is None else null_block
        tables = torch.tensor([t + [pad] * (width - len(t)) for t in block_tables],
                              dtype=torch.int64)  # (S, W)
        q_lens = torch.tensor(query_lens, dtype=torch.int64)  # (S,)
        starts = torch.zeros(S + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=starts[1:])
        if S == T:  # every sequence has one new token: its last position
            seq_of = torch.arange(S)  # (T,)
            positions = torch.tensor(seq_lens, dtype=torch.int64) - 1  # (T,)
        else:
            seq_of = torch.repeat_interleave(torch.arange(S), q_lens)  # (T,) sequence of each token
            context = torch.tensor(seq_lens, dtype=torch.int64) - q_lens  # (S,)
            positions = torch.arange(T) - starts[:-1][seq_of] + context[seq_of]  # (T,)
        slots = tables[seq_of, positions // block_size] * block_size + positions % block_size  # (T,)
        dev = torch.device(device)
        return AttentionMetadata(
            slot_mapping=slots.to(dev),
            block_tables=tables.to(device=dev, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=starts.to(device=dev, dtype=torch.int32),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            seq_lens_host=list(seq_lens), query_lens_host=list(query_lens),
            positions=positions.to(dev), block_size=block_size, null_block=null_block,
            tables_host=[list(t) for t in block_tables])


@dataclass
class DecodeGroup:
    """One-query sequences of similar length, attended together padded to the longest."""

    rows: slice | torch.Tensor  # their rows in the packed batch (a slice when consecutive)
    blocks: torch.Tensor        # (n * width,) int64 block ids, each sequence padded to `width`
    width: int                  # blocks per sequence in this group
    bias: torch.Tensor          # (n, 1, width * B): 0 for the sequence's keys, -inf past its end


@dataclass
class PrefillSequence:
    """A sequence with more than one new token: causal attention, lower-right aligned."""

    start: int                  # its first row in the packed batch
    end: int                    # one past its last row
    seq_len: int                # keys it attends (cached + new)
    blocks: torch.Tensor        # (nb,) int64 blocks holding keys 0..seq_len-1
    mask: torch.Tensor | None   # (Q, seq_len) bool, key j visible to query i iff j <= context + i;
                                # None when nothing was cached (plain causal)


@dataclass
class TorchPlan:
    """Everything the torch backend derives from the metadata, once per step."""

    slot_blocks: torch.Tensor   # (T,) int64 block of each new token's slot
    slot_offsets: torch.Tensor  # (T,) int64 offset inside that block
    decode: list[DecodeGroup]
    prefill: list[PrefillSequence]
    decode_only: bool           # one group covering rows 0..T-1 in order: no output scatter


def build_torch_plan(meta: AttentionMetadata, dtype: torch.dtype, block_size: int) -> TorchPlan:
    """The torch backend's per-step plan (the bias is in `dtype`, the attention's dtype)."""
    device = meta.slot_mapping.device
    B = block_size
    tables = meta.tables_host or [row[:-(-n // B)] for row, n in zip(meta.block_tables.tolist(),
                                                                      meta.seq_lens_host)]
    starts = [0]
    for q in meta.query_lens_host:
        starts.append(starts[-1] + q)
    decode_seqs = [s for s, q in enumerate(meta.query_lens_host) if q == 1]
    groups = _decode_groups(decode_seqs, starts, tables, meta.seq_lens_host, B, meta.null_block, dtype,
                            device)
    prefill = []
    for s, q in enumerate(meta.query_lens_host):
        if q == 1:
            continue
        n = meta.seq_lens_host[s]
        blocks = torch.tensor(tables[s][:-(-n // B)], dtype=torch.int64, device=device)
        mask = None
        if n > q:
            keys = torch.arange(n, device=device)  # (L,)
            mask = keys[None, :] <= torch.arange(n - q, n, device=device)[:, None]  # (Q, L)
        prefill.append(PrefillSequence(starts[s], starts[s + 1], n, blocks, mask))
    T = starts[-1]
    decode_only = not prefill and len(groups) == 1 and groups[0].rows == slice(0, T)
    slots = meta.slot_mapping
    return TorchPlan(slots // B, slots % B, groups, prefill, decode_only)


def _decode_groups(seqs: list[int], starts: list[int], tables: list[list[int]], seq_lens: list[int],
                   B: int, null_block: int | None, dtype: torch.dtype, device) -> list[DecodeGroup]:
    """Group one-query sequences by length; `starts[s]` is the row of sequence s."""
    by_len = sorted(seqs, key=lambda s: -seq_lens[s])
    members: list[list[int]] = []
    width = 0
    for s in by_len:
        nb = -(-seq_lens[s] // B)
        if not members or nb < DECODE_GROUP_RATIO * width:
            members.append([])
            width = nb
        members[-1].append(s)
    groups = []
    for group in members:
        group.sort()
        width = max(-(-seq_lens[s] // B) for s in group)
        flat: list[int] = []
        for s in group:
            own = tables[s][:-(-seq_lens[s] // B)]
            pad = null_block if null_block is not None else own[-1]  # masked either way
            flat += own + [pad] * (width - len(own))
        lens = torch.tensor([seq_lens[s] for s in group], device=device)  # (n,)
        keys = torch.arange(width * B, device=device)  # (L,)
        bias = torch.zeros((len(group), 1, width * B), dtype=dtype, device=device)  # (n, 1, L)
        bias.masked_fill_((keys[None, :] >= lens[:, None])[:, None, :], float("-inf"))
        rows_host = [starts[s] for s in group]
        first, last = rows_host[0], rows_host[-1]
        rows = slice(first, last + 1) if last - first + 1 == len(group) else \
            torch.tensor(rows_host, dtype=torch.int64, device=device)
        groups.append(DecodeGroup(rows, torch.tensor(flat, dtype=torch.int64, device=device), width, bias))
    return groups
