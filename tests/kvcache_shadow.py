"""The shadow model behind the KVCacheManager state machine (test_kvcache_stateful.py).

`Shadow` is what the test believes about one live sequence; `ShadowMachine` holds them, the
deterministic K/V model (a token's K/V is a function of the extra key and the token-id prefix up
to and including it), the engine-like compute step that writes K/V through a table and marks it
computed, and the invariant run after every step: check_integrity(), then every computed token
of every live sequence read back through its table (device pool, or host pool while swapped)
and compared with the shadow. The rules that drive the manager are in the test module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash
from hypothesis.stateful import RuleBasedStateMachine, invariant

from kvcache import KVCacheManager

L, H, D = 2, 1, 2  # one token's K/V: (L, 2, H, D) = 8 float32 values


@dataclass
class Shadow:
    """What the test believes about one live sequence."""

    tokens: list[int]
    extra: str | None
    computed: int = 0
    swapped: bool = False
    kv: list[torch.Tensor] = field(default_factory=list)  # kv[t]: (L, 2, H, D) for t < computed


class ShadowMachine(RuleBasedStateMachine):
    """Shadow state, K/V model and invariant; subclasses add the initialize step and the rules."""

    def __init__(self):
        super().__init__()
        self.manager: KVCacheManager | None = None  # built by the subclass's initialize step
        self.block_size = 0
        self.seqs: dict[int, Shadow] = {}
        self.seen: list[list[int]] = []  # earlier prompts, reused as prefixes of new ones
        self.next_id = 0
        self._kv_cache: dict[tuple, torch.Tensor] = {}

    # ---- model helpers ------------------------------------------------------------------
    def kv(self, extra: str | None, prefix: list[int]) -> torch.Tensor:
        """K/V of the last token of `prefix`: (L, 2, H, D), a function of (extra, prefix) only."""
        key = (extra, tuple(prefix))
        out = self._kv_cache.get(key)
        if out is None:
            h = xxhash.xxh3_128_digest(repr(key).encode())  # 16 bytes -> 8 uint16 values
            vals = np.frombuffer(h, dtype=np.uint16).astype(np.float32)
            out = self._kv_cache[key] = torch.from_numpy(vals.copy()).reshape(L, 2, H, D)
        return out

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def pick(self, i: int, want=None) -> int | None:
        ids = [s for s in sorted(self.seqs) if want is None or want(self.seqs[s])]
        return ids[i % len(ids)] if ids else None

    def compute(self, sid: int, upto: int) -> None:
        """The engine's step: write K/V of tokens computed..upto-1 into their slots, then mark."""
        s, m = self.seqs[sid], self.manager
        end = min(upto, len(s.tokens))
        if end <= s.computed:
            return
        for t, slot in zip(range(s.computed, end), m.slot_mapping(sid, s.computed, end)):
            kv = self.kv(s.extra, s.tokens[:t + 1])
            m.storage.write_slot(slot, kv[:, 0], kv[:, 1])
            s.kv.append(kv)
        m.mark_computed(sid, end)
        s.computed = end

    def compute_after_slots(self, sid: int, how: str) -> None:
        n = len(self.seqs[sid].tokens)
        if how != "none":
            self.compute(sid, n if how == "all" else n - 1)

    def resident_sharers(self, block: int) -> int:
        return sum(block in t.blocks for t in self.manager.tables.values() if not t.swapped)

    # ---- invariant ----------------------------------------------------------------------
    @invariant()
    def tables_and_kv_match_the_shadow(self):
        m, B = self.manager, self.block_size
        m.check_integrity()
        assert set(m.tables) == set(self.seqs)
        reads = {False: ([], [], []), True: ([], [], [])}  # swapped -> (slots, expected, owner)
        for sid, s in self.seqs.items():
            t = m.tables[sid]
            assert (t.token_ids, t.num_computed, t.swapped) == (s.tokens, s.computed, s.swapped)
            assert len(s.kv) == s.computed
            slots, want, owner = reads[s.swapped]
            slots += [t.slot(i, B) for i in range(s.computed)]
            want += s.kv
            owner += [(sid, i) for i in range(s.computed)]
        for swapped, pool in ((False, m.storage), (True, m.host_storage)):
            slots, want, owner = reads[swapped]
            if not slots:
                continue
            got = pool.read_slots(slots)  # (T, L, 2, H, D)
            exp = torch.stack(want)
            if not torch.equal(got, exp):
                bad = next(k for k in range(len(slots)) if not torch.equal(got[k], exp[k]))
                sid, tok = owner[bad]
                raise AssertionError(f"sequence {sid} token {tok} (slot {slots[bad]}, swapped={swapped}) "
                                     f"reads K/V {got[bad].flatten().tolist()}, "
                                     f"expected {exp[bad].flatten().tolist()}")
        resident = {b for t in m.tables.values() if not t.swapped for b in t.blocks}
        assert m.allocator.num_used == len(resident)
