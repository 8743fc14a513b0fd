"""Decode K/V mirror for the torch attention backend: a persistent per-slot buffer.

Each sequence that decodes in consecutive steps keeps, per layer, its keys and values in one
contiguous head-major buffer (slot, Hkv, position, D). Decode attention then reads them where
they lie, with one batched matmul pair over (slot, kv head) and no grouped-query expansion,
instead of gathering every block of every sequence every step; a step only adds each sequence's
new token. The paged pool stays the source of truth: a sequence enters the mirror by one gather
of its blocks (its first decode step, or after any step it did not decode in: preemption, swap,
fork and import all come back that way), leaves it the first step it does not decode, and the
slots of those present are kept dense (0..n-1) by moving entries into holes. Each layer's mirror
is one buffer, as large as the pool when first allocated, viewed as slots x positions (each slot
padded to the longest length its sequences can reach); a longer sequence re-lays it out and
refills it from the pool. When the slots do not fit, the buffers grow (by half at least) up to
`MAX_GROWTH` times the pool: with prompts of mixed lengths, padding the short ones takes more
than the pool holds. An engine that decodes allocates and zeroes the pool-sized part at start
(`warm`). On CPU that much address space is reserved at first use and taken as needed
(no copy, no page touched before a fill writes it); elsewhere growing copies what was held. A
slot past the part zeroed at first use gets its padding zeroed when filled, so nothing read is
ever uninitialised. The mirror serves a step only while padding every sequence to the longest
stays within `MAX_PADDING` of the tokens attended and the slots fit; otherwise `plan` returns
None, the mirror empties, and the backend gathers blocks by length group. Not thread-safe: one
per engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attn_metadata import int64_tensor

MAX_PADDING = 2.0  # padded key slots / attended keys above which the grouped gather path is used
MAX_GROWTH = 2.0   # the most tokens each layer's buffer may hold, in pool sizes


@dataclass
class MirrorStep:
    """What every layer does to its mirror this step, then how decode attends (built once)."""

    num: int                            # decoding sequences, in slots 0..num-1
    length: int                         # longest context among them (keys attended, padded)
    positions_per_slot: int             # the layout: buffers are viewed (tokens // this, Hkv, this, D)
    moves: list[tuple[int, int]]        # (from slot, to slot) entries to move
    fills: tuple[list[int], torch.Tensor, int] | None  # (slots, blocks (k * width,), width)
    rows: torch.Tensor | None           # (num,) packed-batch row of slot i (None: row i)
    positions: torch.Tensor             # (num,) position of slot i's new token
    bias: torch.Tensor                  # (num * Hkv, 1, length): 0, or -inf past a sequence's end
    slots: torch.Tensor | None = None   # (num,) int64 0..num-1 (the new tokens' slots, built once)
    tokens: int = 0                     # tokens each layer's buffers hold (prepare grows them if short)
    reserve: int = 0                    # the most tokens they may come to hold (MAX_GROWTH pools)


class DecodeMirror:
    def __init__(self) -> None:
        self.buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> flat (K, V)
        self.entries: dict[object, tuple[int, int, int]] = {}  # seq id -> (slot, tokens held, first block)
        self.positions = 0  # positions per slot of the current layout (0: none yet)
        self.tokens = 0  # tokens each layer's buffers hold (0: none yet)
        self.finite: dict[int, int] = {}  # layer -> tokens from its buffers' start zeroed or written

    def plan(self, seq_ids: list, rows: list[int], seq_lens: list[int], tables: list[list[int]],
             final_len: int, block_size: int, num_kv_heads: int, pool_tokens: int, dtype: torch.dtype,
             device: torch.device) -> MirrorStep | None:
        """Slots for this step's decode sequences (row r of `rows` has id seq_ids[r], context
        seq_lens[r] after this step, blocks tables[r]), or None (and an empty mirror).
        final_len: the longest any of them can grow to (0: unknown)."""
        num, length = len(seq_ids), max(seq_lens)
        width = -(-length // block_size)
        layout = -(-max(final_len, width * block_size) // block_size) * block_size
        capacity = int(MAX_GROWTH * pool_tokens)
        if num * length > MAX_PADDING * sum(seq_lens) + num * block_size or num * layout > capacity:
            self.entries.clear()
            return None
        if width * block_size > self.positions or num * self.positions > capacity:
            self.positions = layout  # a new layout (longer, or more slots): every entry is refilled
            self.entries.clear()
        if num * self.positions > self.tokens:  # the buffers grow; slot-major, so entries keep their place
            self.tokens = min(capacity, max(pool_tokens, num * self.positions, self.tokens * 3 // 2))
        keep: dict[object, int] = {}  # sequences whose entry holds exactly their tokens before this one
        for seq_id, n, table in zip(seq_ids, seq_lens, tables):
            entry = self.entries.get(seq_id)
            if entry is not None and entry[1] == n - 1 and entry[2] == table[0]:
                keep[seq_id] = entry[0]
        free = sorted(set(range(num)) - {s for s in keep.values() if s < num})
        moves_from, moves_to, slot_of = [], [], {}
        for seq_id, slot in keep.items():
            if slot >= num:  # past the dense range: move into a hole
                moves_from.append(slot)
                moves_to.append(free.pop(0))
                slot_of[seq_id] = moves_to[-1]
            else:
                slot_of[seq_id] = slot
        fill_slots, fill_blocks = [], []
        for seq_id, n, table in zip(seq_ids, seq_lens, tables):
            if seq_id not in slot_of:
                slot_of[seq_id] = free.pop(0)
                fill_slots.append(slot_of[seq_id])
                nb = -(-n // block_size)
                fill_blocks += table[:nb] + [table[nb - 1]] * (width - nb)  # padding is masked
        self.entries = {seq_id: (slot_of[seq_id], n, table[0])
                        for seq_id, n, table in zip(seq_ids, seq_lens, tables)}
        order = sorted(range(num), key=lambda r: slot_of[seq_ids[r]])  # order[i]: the row in slot i
        lens = int64_tensor([seq_lens[r] for r in order], device)  # (num,) by slot
        past = torch.arange(length, device=device) >= lens[:, None]  # (num, L)
        bias = torch.where(past, float("-inf"), 0.0).to(dtype).repeat_interleave(num_kv_heads, 0)
        by_slot = [rows[r] for r in order]
        fills = None if not fill_slots else (fill_slots, int64_tensor(fill_blocks, device), width)
        return MirrorStep(num, length, self.positions, list(zip(moves_from, moves_to)), fills,
                          None if by_slot == list(range(num)) else int64_tensor(by_slot, device),
                          lens - 1, bias[:, None, :],  # bias: (num * Hkv, 1, L)
                          torch.arange(num, device=device), self.tokens, capacity)

    def warm(self, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Allocate and zero every layer's pool-sized buffers now (caches: each layer's (K, V)
        pool views (N, B, Hkv, D)), as the first decode step would: an engine that decodes calls
        this at start, so its first request does not pay for it (SmolLM2 with 512 blocks: 377 MB
        zeroed, 0.15-0.7 s)."""
        for layer, (k_cache, v_cache) in enumerate(caches):
            if layer not in self.buffers:
                pool_tokens = k_cache.shape[0] * k_cache.shape[1]
                self._grow(layer, k_cache, v_cache, pool_tokens, int(MAX_GROWTH * pool_tokens))
                self.tokens = pool_tokens

    def _grow(self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor, tokens: int,
              reserve: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Give `layer` buffers for `tokens` tokens (on CPU, address space for `reserve`), keeping
        what it held and zeroing the rest up to `tokens`; returns them (flat K, V)."""
        _, _, Hkv, D = k_cache.shape
        need = tokens * Hkv * D
        # on CPU, address space for the most the buffers may hold: growing into it touches no page
        # before a fill writes it (a first touch costs about 2 us a page on the bench VM)
        size = max(need, reserve * Hkv * D) if k_cache.device.type == "cpu" else need
        grown = (k_cache.new_empty(size), v_cache.new_empty(size))
        buffers = self.buffers.get(layer)
        held = 0 if buffers is None else buffers[0].numel()
        for i, new in enumerate(grown):
            if held:  # the slots held so far, where they were (slot-major)
                new[:held].copy_(buffers[i])
            new[held:need].zero_()  # padding reads finite values
        self.buffers[layer] = grown
        self.finite[layer] = tokens  # tokens from the start known to read finite
        return grown

    def prepare(self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                step: MirrorStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Move and fill this layer's entries for the step; returns its (K, V) viewed (S, Hkv, P, D)."""
        _, B, Hkv, D = k_cache.shape
        buffers = self.buffers.get(layer)
        if buffers is None or buffers[0].numel() < step.tokens * Hkv * D:
            buffers = self._grow(layer, k_cache, v_cache, step.tokens, step.reserve)
        P = step.positions_per_slot
        slots = step.tokens // P
        keys, values = (buffer[:slots * Hkv * P * D].view(slots, Hkv, P, D)  # (S, Hkv, P, D)
                        for buffer in buffers)
        # one slice copy per entry: a few entries a step, and indexed assignment (index_put_) would
        # copy element by element (2-3x slower here)
        for source, target in step.moves:
            for buffer in (keys, values):
                buffer[target, :, :step.length].copy_(buffer[source, :, :step.length])  # (Hkv, L, D)
        if step.fills is not None:
            targets, blocks, width = step.fills
            for buffer, cache in ((keys, k_cache), (values, v_cache)):
                gathered = cache.index_select(0, blocks).view(len(targets), width * B, Hkv, D)  # (k, W B, ..)
                for i, target in enumerate(targets):
                    buffer[target, :, :width * B].copy_(gathered[i].transpose(0, 1))  # (Hkv, W B, D)
                    if (target + 1) * P > self.finite[layer]:  # reserved, never written: padding reads
                        buffer[target, :, width * B:].zero_()  # finite values once zeroed
        return keys, values
