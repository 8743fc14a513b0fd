"""Hypothesis state machine over KVCacheManager with a real KVStorage and a host pool for swap.

Random allocate / append / fork / compute (write K/V, then mark_computed) / free / evict / match /
swap / adopt sequences run on tiny pools. A token's K/V is a deterministic function of the extra
key and the token-id prefix up to and including it, so a prefix-cache hit must read back exactly
what a fresh computation would write. After every step the invariant (kvcache_shadow.py) runs
check_integrity() and reads every computed token of every live sequence back through its table
(device pool, or host pool while swapped) and compares it with the shadow kept per sequence. A
block freed or reused while a table still names it, a missing copy-on-write, or a wrong prefix
hit shows up there as different K/V, the way it would show up as wrong attention scores.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, event, settings, strategies
from hypothesis.stateful import initialize, precondition, rule
from kvcache_shadow import D, H, L, Shadow, ShadowMachine

from kvcache import BlockAllocator, KVCacheManager, KVLayout, KVStorage, blocks_for

TOKENS = strategies.integers(0, 2)  # a small alphabet, so prefixes repeat
PICK = strategies.integers(0, 10**6)
EXTRA_KEYS = strategies.sampled_from([None, None, None, "lora-x"])
# After giving tokens slots: compute them all, none (later compute_some), or all but the last
# (a chunked prefill), which leaves full blocks with uncomputed tokens that must not be shared.
COMPUTE = strategies.sampled_from(["all", "all", "none", "part"])


# At least 300 runs of up to 35 steps each; the settings carry over to KVCacheMachine.TestCase.
@settings(max_examples=300, stateful_step_count=35, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
class KVCacheMachine(ShadowMachine):
    # ---- rules --------------------------------------------------------------------------
    @initialize(block_size=strategies.sampled_from([1, 2, 4]), num_blocks=strategies.integers(6, 24),
                host_blocks=strategies.integers(1, 12),
                caching=strategies.sampled_from([True, True, True, False]))
    def setup(self, block_size, num_blocks, host_blocks, caching):
        layout = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, block_size=block_size)
        self.block_size = block_size
        self.manager = KVCacheManager(BlockAllocator(num_blocks), block_size, KVStorage(layout, num_blocks),
                                      enable_prefix_caching=caching,
                                      host_storage=KVStorage(layout, host_blocks))

    @rule(stem=PICK, use_stem=strategies.sampled_from([True, True, False]), cut=strategies.integers(0, 12),
          tail=strategies.lists(TOKENS, max_size=8), extra=EXTRA_KEYS, compute=COMPUTE)
    def allocate(self, stem, use_stem, cut, tail, extra, compute):
        m, B = self.manager, self.block_size
        prompt = (self.seen[stem % len(self.seen)][:cut] if use_stem and self.seen else []) + tail
        prompt = prompt or [0]
        sid = self.new_id()
        avail = m.allocator.num_available
        hits = m.match_prefix(prompt, extra)
        revive = sum(m.allocator.ref_count(b) == 0 for b in hits)
        got = m.allocate(sid, prompt, extra)
        if blocks_for(len(prompt), B) - len(hits) + revive > avail:
            assert got is None and sid not in m.tables and m.allocator.num_available == avail
            return
        assert got == len(hits) * B <= (len(prompt) - 1) // B * B
        assert m.table(sid).blocks[:len(hits)] == hits
        event("prefix hit" if got else "no prefix hit")
        self.seen.append(list(prompt))
        s = self.seqs[sid] = Shadow(tokens=list(prompt), extra=extra, computed=got)
        s.kv = [self.kv(extra, prompt[:t + 1]) for t in range(got)]  # already in the hit blocks
        self.compute_after_slots(sid, compute)

    @precondition(lambda self: self.seqs)
    @rule(i=PICK, toks=strategies.lists(TOKENS, min_size=1, max_size=5), compute=COMPUTE)
    def append(self, i, toks, compute):
        self.append_to(self.pick(i), toks, compute)

    def append_to(self, sid, toks, compute):
        m, B = self.manager, self.block_size
        s, t = self.seqs[sid], m.table(sid)
        if s.swapped:
            with pytest.raises(ValueError, match="swapped out"):
                m.append(sid, toks)
            return
        n, nb, old = len(t.token_ids), len(t.blocks), list(t.blocks)
        fill = n - (nb - 1) * B
        cow = 0 < fill < B and self.resident_sharers(t.blocks[-1]) > 1
        need = blocks_for(n + len(toks), B) - nb + cow
        avail = m.allocator.num_available
        ok = m.append(sid, toks)
        assert ok == (need <= avail)
        if not ok:
            assert t.blocks == old and t.token_ids == s.tokens and m.allocator.num_available == avail
            return
        event("copy-on-write" if cow else "append in place")
        assert t.blocks[:nb - 1] == old[:nb - 1]  # tables only grow
        assert (t.blocks[nb - 1] != old[nb - 1]) == cow
        assert m.allocator.num_available == avail - need
        s.tokens += toks
        self.compute_after_slots(sid, compute)

    @precondition(lambda self: any(not s.swapped and s.computed < len(s.tokens) for s in self.seqs.values()))
    @rule(i=PICK, k=strategies.integers(1, 4))
    def compute_some(self, i, k):
        sid = self.pick(i, lambda s: not s.swapped and s.computed < len(s.tokens))
        self.compute(sid, self.seqs[sid].computed + k)

    @precondition(lambda self: self.seqs)
    @rule(i=PICK, then=strategies.sampled_from([None, "parent", "child", "both"]),
          toks=strategies.lists(TOKENS, min_size=1, max_size=3), compute=COMPUTE)
    def fork(self, i, then, toks, compute):
        """Fork, then often append at once (the copy-on-write path). 'both' appends to the child,
        then a different continuation to the parent, as beam search does: with a shared partial
        tail, a missing copy-on-write lets the second write clobber the first."""
        m = self.manager
        sid = self.pick(i)
        s = self.seqs[sid]
        child = self.new_id()
        if s.swapped:
            with pytest.raises(ValueError, match="swapped-out"):
                m.fork(sid, child)
            return
        avail = m.allocator.num_available
        m.fork(sid, child)
        assert m.allocator.num_available == avail and m.table(child).blocks == m.table(sid).blocks
        self.seqs[child] = Shadow(tokens=list(s.tokens), extra=s.extra, computed=s.computed, kv=list(s.kv))
        if then in ("child", "both"):
            self.append_to(child, toks, compute)
        if then in ("parent", "both"):
            self.append_to(sid, [(x + 1) % 3 for x in toks] if then == "both" else toks, compute)

    @precondition(lambda self: self.seqs)
    @rule(i=PICK)
    def free(self, i):
        m = self.manager
        sid = self.pick(i)
        s, t = self.seqs.pop(sid), m.table(sid)
        if s.swapped:
            host = m.host_allocator.num_available
            m.free(sid)
            assert m.host_allocator.num_available == host + len(t.blocks)
        else:
            released = sum(self.resident_sharers(b) == 1 for b in t.blocks)
            avail = m.allocator.num_available
            m.free(sid)
            assert m.allocator.num_available == avail + released
        self.seen.append(s.tokens)

    @rule(n=strategies.one_of(strategies.none(), strategies.integers(0, 3)))
    def evict(self, n):
        a = self.manager.allocator
        cached, avail = a.num_cached, a.num_available
        got = a.evict_cached(n)
        assert got == (cached if n is None else min(n, cached))
        assert a.num_cached == cached - got and a.num_available == avail

    @precondition(lambda self: self.seqs)
    @rule(i=PICK)
    def swap_out(self, i):
        m = self.manager
        sid = self.pick(i)
        s, t = self.seqs[sid], m.table(sid)
        if s.swapped:
            with pytest.raises(ValueError, match="already swapped out"):
                m.swap_out(sid)
            return
        fits = len(t.blocks) <= m.host_allocator.num_available
        assert m.swap_out(sid) == fits
        s.swapped = fits
        event("swap out" if fits else "swap out refused")

    @precondition(lambda self: any(s.swapped for s in self.seqs.values()))
    @rule(i=PICK)
    def swap_in(self, i):
        m = self.manager
        sid = self.pick(i, lambda s: s.swapped)
        fits = len(m.table(sid).blocks) <= m.allocator.num_available
        assert m.swap_in(sid) == fits
        self.seqs[sid].swapped = not fits
        event("swap in" if fits else "swap in refused")

    @rule(stem=PICK, tail=strategies.lists(TOKENS, max_size=4), extra=EXTRA_KEYS)
    def match(self, stem, tail, extra):
        """Blocks match_prefix offers must hold exactly the K/V of the prompt's prefix."""
        m, B = self.manager, self.block_size
        prompt = (self.seen[stem % len(self.seen)] if self.seen else []) + tail
        if not prompt:
            return
        blocks = m.match_prefix(prompt, extra)
        assert len(blocks) <= (len(prompt) - 1) // B
        assert m.enable_prefix_caching or not blocks
        if not blocks:
            return
        assert all(m.allocator.hash_of(b) is not None for b in blocks)
        got = m.storage.read_slots([b * B + j for b in blocks for j in range(B)])  # (T, L, 2, H, D)
        want = torch.stack([self.kv(extra, prompt[:t + 1]) for t in range(len(blocks) * B)])
        assert torch.equal(got, want), "a block offered by match_prefix does not hold that prefix's K/V"

    @rule(toks=strategies.lists(TOKENS, min_size=1, max_size=8), extra=EXTRA_KEYS)
    def adopt(self, toks, extra):
        """KV import: take raw blocks, fill them, hand them to a new table."""
        m, B = self.manager, self.block_size
        blocks = m.allocator.allocate_many(blocks_for(len(toks), B))
        if blocks is None:
            return
        s = Shadow(tokens=list(toks), extra=extra, computed=len(toks))
        for t in range(len(toks)):
            kv = self.kv(extra, toks[:t + 1])
            m.storage.write_slot(blocks[t // B] * B + t % B, kv[:, 0], kv[:, 1])
            s.kv.append(kv)
        sid = self.new_id()
        m.adopt(sid, blocks, toks, extra)
        self.seqs[sid] = s

    @rule(i=PICK, which=strategies.sampled_from(["double_free", "unknown_seq", "existing_id", "bad_block"]))
    def misuse(self, i, which):
        """Misuse raises ValueError and changes nothing (the invariant checks the state)."""
        m = self.manager
        a = m.allocator
        if which == "double_free" and a.num_free:
            with pytest.raises(ValueError, match="double free"):
                a.free(a._clean[0])
        elif which == "unknown_seq":
            with pytest.raises(ValueError, match="unknown sequence"):
                m.free(-1)
        elif which == "existing_id" and self.seqs:
            with pytest.raises(ValueError, match="already has a block table"):
                m.allocate(self.pick(i), [0])
        elif which == "bad_block":
            with pytest.raises(ValueError, match="unknown block id"):
                a.incref(a.num_blocks + i % 3)


TestKVCacheStateful = KVCacheMachine.TestCase
