"""The vectorised block arithmetic equals the plain loops it replaced (property-based): the
chained prefix hashes of `protocol.prefix_hash.hash_chain` against `hash_block` one block at a
time (any block size, extra key, start and stop), and `transfer.blocks.skipped_blocks` against
the per-block membership loop (any sizes, any reuse set, out-of-range indices included)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.table import blocks_for
from protocol.prefix_hash import ROOT_HASH, hash_block, hash_chain
from transfer.blocks import skipped_blocks


def _loop_hashes(tokens, B, key):
    out, parent = [], ROOT_HASH
    for i in range(len(tokens) // B):
        parent = hash_block(parent, tokens[i * B:(i + 1) * B], key)
        out.append(parent)
    return out


def _loop_skipped(n, B, reuse, R):
    out = []
    for s in range(blocks_for(n, B)):
        lo, hi = s * B, min((s + 1) * B, n)
        out.append(bool(reuse) and all(j in reuse for j in range(lo // R, (hi - 1) // R + 1)))
    return out


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**40), max_size=200), B=st.integers(1, 33),
       key=st.one_of(st.none(), st.text(max_size=5), st.binary(max_size=5)), data=st.data())
def test_hash_chain_equals_hash_block_in_a_loop(tokens, B, key, data):
    want = _loop_hashes(tokens, B, key)
    assert hash_chain(tokens, B, key) == want
    start = data.draw(st.integers(0, len(want)))
    stop = data.draw(st.integers(start, len(want)))
    parent = want[start - 1] if start else ROOT_HASH
    assert hash_chain(tokens, B, key, parent, start, stop) == want[start:stop]


@settings(max_examples=500, deadline=None)
@given(n=st.integers(0, 400), B=st.integers(1, 40), R=st.integers(1, 70),
       reuse=st.sets(st.integers(-3, 60), max_size=20), prefix=st.booleans())
def test_skipped_blocks_equals_the_membership_loop(n, B, R, reuse, prefix):
    if prefix:  # what a dedupe answer looks like: a run of leading receiver blocks
        reuse = set(range(len(reuse)))
    assert skipped_blocks(n, B, reuse, R) == _loop_skipped(n, B, reuse, R)
