"""Batch description that every attention backend reads for one forward step.

A step runs S sequences with T new tokens in total, packed back to back (varlen, no padding).
Sequence s contributes tokens query_start_loc[s]:query_start_loc[s+1]; those are its last
q_len positions, so query i of sequence s sits at absolute position
seq_lens[s] - q_len + i and attends causally to positions 0..that position through its block
table. Decode is the case q_len == 1; prefill after a prefix-cache hit is q_len < seq_len.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor     # (T,) int64: physical slot (block * B + offset) of each new token
    block_tables: torch.Tensor     # (S, max_blocks) int32, rows padded with 0 past their length
    seq_lens: torch.Tensor         # (S,) int32: context length after this step (cached + new)
    query_start_loc: torch.Tensor  # (S + 1,) int32: cumulative new-token offsets, [0] == 0
    max_query_len: int
    max_seq_len: int
    # Host copies (python ints) so the torch reference never syncs with the device.
    seq_lens_host: list[int]
    query_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @staticmethod
    def build(block_tables: list[list[int]], seq_lens: list[int], query_lens: list[int],
              block_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
        """From per-sequence host lists: tables, context lengths after the step, new tokens."""
        if not (len(block_tables) == len(seq_lens) == len(query_lens)):
            raise ValueError("block_tables, seq_lens and query_lens must have one entry per sequence")
        slots: list[int] = []
        for table, n, q in zip(block_tables, seq_lens, query_lens):
            if not 1 <= q <= n or len(table) * block_size < n:
                raise ValueError(f"bad sequence: q_len {q}, seq_len {n}, {len(table)} blocks of {block_size}")
            slots += [table[t // block_size] * block_size + t % block_size for t in range(n - q, n)]
        width = max(len(t) for t in block_tables)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        dev = torch.device(device)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            seq_lens_host=list(seq_lens), query_lens_host=list(query_lens))
