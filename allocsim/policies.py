"""The three allocation policies the simulator compares, behind one small duck-typed interface.

- `MaxReservation`: one contiguous interval of prompt + max_new_tokens, reserved on admission.
- `ExactContiguous`: one contiguous interval of the prompt, extended in place one slot per token;
  relocation is not allowed, so growth needs the slot just after the interval to be free.
- `Paged`: the real `kvcache.BlockAllocator` (capacity // B blocks) under a `KVCacheManager`
  without storage: ceil(prompt / B) blocks on admission, one more block whenever the token count
  before an append is a multiple of B.

Contiguous placement is first-fit at the lowest address (`_Arena`). Every policy answers the same
questions: the slots an admission or an append asks for, whether it succeeded, the slots a
request holds, free slots, the largest contiguous free interval, and the slot layout (for the
figure) as segments `(first_slot, length, request_id, live)`.
"""

from __future__ import annotations

from allocsim.scenario import Request, Scenario
from kvcache.allocator import BlockAllocator
from kvcache.manager import KVCacheManager, blocks_for

Segment = tuple[int, int, str, bool]  # (first slot, number of slots, request id, live?)


class _Arena:
    """Intervals [start, end) of slots 0..capacity-1, one per owner, placed first-fit lowest address."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.spans: dict[str, list[int]] = {}  # owner -> [start, end)

    def gaps(self) -> list[tuple[int, int]]:
        """Free intervals [start, end) in address order."""
        out, pos = [], 0
        for start, end in sorted(self.spans.values()):
            if start > pos:
                out.append((pos, start))
            pos = end
        if pos < self.capacity:
            out.append((pos, self.capacity))
        return out

    def place(self, owner: str, n: int) -> bool:
        if owner in self.spans:
            raise ValueError(f"request {owner!r} already holds an interval")
        for start, end in self.gaps():
            if end - start >= n:
                self.spans[owner] = [start, start + n]
                return True
        return False

    def extend(self, owner: str) -> bool:
        """Grow the owner's interval by one slot in place; False if that slot is taken or past the end."""
        span = self._span(owner)
        nxt = span[1]
        if nxt >= self.capacity or any(s[0] == nxt for s in self.spans.values()):
            return False
        span[1] += 1
        return True

    def release(self, owner: str) -> None:
        self._span(owner)
        del self.spans[owner]

    def held(self, owner: str) -> int:
        start, end = self._span(owner)
        return end - start

    def free(self) -> int:
        return self.capacity - sum(e - s for s, e in self.spans.values())

    def largest_free(self) -> int:
        return max((e - s for s, e in self.gaps()), default=0)

    def check_integrity(self) -> None:
        """Intervals are non-empty, inside the arena and pairwise disjoint."""
        pos = 0
        for start, end in sorted(self.spans.values()):
            if not pos <= start < end <= self.capacity:
                raise RuntimeError(f"arena interval [{start}, {end}) overlaps or leaves 0..{self.capacity}")
            pos = end

    def _span(self, owner: str) -> list[int]:
        try:
            return self.spans[owner]
        except KeyError:
            raise ValueError(f"request {owner!r} holds no interval") from None


class _Contiguous:
    """Shared behaviour of the two contiguous policies (they differ in admission and growth)."""

    name = "contiguous"

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.arena = _Arena(capacity)

    def release(self, rid: str) -> None:
        self.arena.release(rid)

    def held(self, rid: str) -> int:
        return self.arena.held(rid)

    def free_slots(self) -> int:
        return self.arena.free()

    def largest_free_interval(self) -> int:
        return self.arena.largest_free()

    def check_integrity(self) -> None:
        self.arena.check_integrity()

    def layout(self, live: dict[str, int]) -> list[Segment]:
        """Slots of every holder: its first live[rid] slots hold tokens, the rest is waste."""
        segs: list[Segment] = []
        for rid, (start, end) in self.arena.spans.items():
            n = min(live[rid], end - start)
            segs.append((start, n, rid, True))
            if end - start > n:
                segs.append((start + n, end - start - n, rid, False))
        return segs


class MaxReservation(_Contiguous):
    """Reserve prompt + max_new_tokens contiguous slots up front; growth never allocates."""

    name = "max_reservation"

    def admit_slots(self, req: Request) -> int:
        return req.prompt + req.max_new_tokens

    def admit(self, req: Request) -> bool:
        return self.arena.place(req.id, self.admit_slots(req))

    def grow_slots(self, rid: str) -> int:
        return 0

    def grow(self, rid: str) -> bool:
        return True  # output <= max_new_tokens, so the reservation always has room


class ExactContiguous(_Contiguous):
    """Reserve the prompt contiguously, then extend in place one slot per generated token."""

    name = "exact_contiguous"

    def admit_slots(self, req: Request) -> int:
        return req.prompt

    def admit(self, req: Request) -> bool:
        return self.arena.place(req.id, req.prompt)

    def grow_slots(self, rid: str) -> int:
        return 1

    def grow(self, rid: str) -> bool:
        return self.arena.extend(rid)


class Paged:
    """Fixed-size blocks from the workers' own BlockAllocator, through a storage-less KVCacheManager."""

    def __init__(self, capacity: int, block_size: int):
        self.block_size = block_size
        self.name = f"paged_{block_size}"
        self.allocator = BlockAllocator(capacity // block_size)
        # No prefix caching: the simulator's token ids are placeholders, and sharing is not modelled.
        self.manager = KVCacheManager(self.allocator, block_size, storage=None, enable_prefix_caching=False)

    def admit_slots(self, req: Request) -> int:
        return blocks_for(req.prompt, self.block_size) * self.block_size

    def admit(self, req: Request) -> bool:
        return self.manager.allocate(req.id, [0] * req.prompt) is not None

    def grow_slots(self, rid: str) -> int:
        return self.manager.blocks_needed_to_append(rid, 1) * self.block_size

    def grow(self, rid: str) -> bool:
        return self.manager.append(rid, [0])

    def release(self, rid: str) -> None:
        self.manager.free(rid)

    def held(self, rid: str) -> int:
        return len(self.manager.table(rid).blocks) * self.block_size

    def free_slots(self) -> int:
        return self.allocator.num_available * self.block_size

    def largest_free_interval(self) -> int:
        return self.free_slots()  # any free block serves any request

    def check_integrity(self) -> None:
        self.manager.check_integrity()

    def layout(self, live: dict[str, int]) -> list[Segment]:
        """Each block of each table: its filled slots are live, the unfilled tail is waste."""
        B, segs = self.block_size, []
        for rid, table in self.manager.tables.items():
            for i, block in enumerate(table.blocks):
                n = max(0, min(B, live[rid] - i * B))
                if n:
                    segs.append((block * B, n, rid, True))
                if n < B:
                    segs.append((block * B + n, B - n, rid, False))
        return segs


def make_policies(scenario: Scenario) -> list:
    """Fresh policies in report order: max_reservation, exact_contiguous, paged_B per block size."""
    cap = scenario.capacity
    return [MaxReservation(cap), ExactContiguous(cap)] + [Paged(cap, b) for b in scenario.block_sizes]
