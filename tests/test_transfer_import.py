"""Export/import between two in-process pools: exact KV after the move, coalesced zero-copy
frames, re-blocking between block sizes, dedupe of held prefix blocks, leases and epochs, and
every bad-input case leaving the receiver's pool exactly as it was (with the error counted)."""

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache.storage import KVLayout
from measure.pools import fill_random_sequence, make_manager
from transfer import errors as E
from transfer.blocks import prefix_hashes_at
from transfer.epochs import EpochGuard
from transfer.export import ExportConfig, export_sequence
from transfer.importer import import_sequence
from transfer.lease import LeaseTable
from transfer.metrics import TransferMetrics
from transfer.wire_codec import encode

SHAPE = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16"}  # 128 B/token


def pool(B=16, n=64, caching=True, **over):
    return make_manager(KVLayout(block_size=B, **{**SHAPE, **over}), n, prefix_caching=caching)


def kv(manager, seq_id) -> torch.Tensor:
    """(T, L, 2, H, D) KV of the computed tokens, as raw bytes (random bytes may be NaN)."""
    t = manager.table(seq_id)
    slots = [t.slot(i, manager.block_size) for i in range(t.num_computed)]
    return manager.storage.read_slots(slots).contiguous().view(torch.uint8)


def snapshot(manager):
    a = manager.allocator
    return (a.num_free, a.num_cached, a.num_used, sorted(manager.tables, key=str),
            [a.ref_count(b) for b in range(a.num_blocks)], sorted(a.cached_hashes()))


def fragmented_source(order, B=16):
    """A pool whose clean queue hands blocks out in `order` (then the rest)."""
    src = pool(B, n=max(order) + 8)
    blocks = src.allocator.allocate_many(src.allocator.num_blocks)
    rest = [b for b in blocks if b not in order]
    src.allocator.free_many(list(order) + rest)
    return src


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(7)


@pytest.mark.parametrize("chunk", [4096, 5000, 1 << 20])
def test_move_is_exact_coalesced_and_zero_copy(gen, chunk):
    src = fragmented_source([4, 5, 6, 0, 1, 9, 2, 3])
    tokens = fill_random_sequence(src, "a", 100, gen)  # 7 blocks: physical 4 5 6 | 0 1 | 9 | 2
    sampling = {"temperature": 0.3, "seed": 9, "n": 2}
    state = {"token_ids": tokens + [42], "sampling": sampling, "num_generated": 1}
    ex = export_sequence(src, "a", "req", 1, state, config=ExportConfig(chunk_bytes=chunk))
    assert [(f.first_block, f.num_blocks) for f in ex.manifest.frames] == [(0, 3), (3, 2), (5, 1), (6, 1)]
    bb = src.storage.layout.block_bytes
    for f, buf in zip(ex.manifest.frames, ex.frames):  # views of pool memory, not copies
        phys = src.table("a").blocks[f.first_block]
        assert np.frombuffer(buf, np.uint8).ctypes.data == src.storage.data[phys].data_ptr()
        assert buf.nbytes == f.num_blocks * bb
    dst, metrics = pool(), TransferMetrics()
    res = import_sequence(dst, encode(ex.manifest), ex.frames, metrics=metrics)
    assert torch.equal(kv(dst, "req"), kv(src, "a"))
    assert res.state.token_ids == tokens + [42] and res.state.num_generated == 1
    assert res.state.sampling == {**res.state.sampling, **sampling}
    assert dst.table("req").token_ids == tokens and res.new_blocks == 7
    assert [dst.allocator.lookup(h) for h in prefix_hashes_at(tokens, 16)] == dst.table("req").blocks[:6]
    assert metrics.counters["imports"] == 1 and not metrics.errors
    ex.release()
    src.check_integrity()
    dst.check_integrity()


@pytest.mark.parametrize("src_bs, dst_bs", [(16, 32), (32, 16), (16, 8), (8, 16), (16, 24)])
@pytest.mark.parametrize("stage", [False, True])
def test_reblock_between_block_sizes(gen, src_bs, dst_bs, stage):
    src, dst = pool(src_bs), pool(dst_bs, n=128)
    tokens = fill_random_sequence(src, "a", 77, gen)
    ex = export_sequence(src, "a", "req", 1, config=ExportConfig(chunk_bytes=4096, stage=stage))
    res = import_sequence(dst, ex.manifest, ex.frames, stage=stage)
    assert len(dst.table("req").blocks) == -(-77 // dst_bs) == res.new_blocks
    assert dst.table("req").token_ids == tokens
    assert torch.equal(kv(dst, "req"), kv(src, "a"))
    ex.release()
    dst.check_integrity()


def test_staged_export_and_import_same_block_size(gen):
    src, dst = fragmented_source([3, 4, 0, 7, 8, 9]), pool()
    fill_random_sequence(src, "a", 90, gen)
    ex = export_sequence(src, "a", "r", 1, config=ExportConfig(chunk_bytes=5000, stage=True))
    import_sequence(dst, ex.manifest, ex.frames, stage=True)
    assert torch.equal(kv(dst, "r"), kv(src, "a"))


@pytest.mark.parametrize("dst_bs", [16, 32, 8])
def test_dedupe_sends_only_missing_blocks_and_shares_held_ones(gen, dst_bs):
    src, dst = pool(), pool(dst_bs, n=64)
    prefix = fill_random_sequence(src, "a", 64, gen)
    ex = export_sequence(src, "a", "ra", 1)
    import_sequence(dst, ex.manifest, ex.frames)
    ex.release()
    tokens = fill_random_sequence(src, "b", 90, gen, token_ids=prefix + list(range(26)))
    held = [i for i, h in enumerate(prefix_hashes_at(tokens, dst_bs)) if dst.allocator.lookup(h) is not None]
    assert held == list(range(64 // dst_bs))
    ex = export_sequence(src, "b", "rb", 1, reuse=held, reuse_block_size=dst_bs)
    sent = sum(f.num_blocks for f in ex.manifest.frames)
    assert sent == 6 - 4  # 4 of the sender's 6 blocks lie wholly inside held receiver blocks
    before_free = dst.allocator.num_available
    res = import_sequence(dst, encode(ex.manifest), ex.frames)
    assert res.reused_blocks == len(held) and dst.allocator.num_available == before_free - res.new_blocks
    assert dst.table("rb").blocks[:len(held)] == dst.table("ra").blocks[:len(held)]
    assert all(dst.allocator.ref_count(b) == 2 for b in dst.table("ra").blocks[:len(held)])
    assert torch.equal(kv(dst, "rb"), kv(src, "b"))
    dst.check_integrity()


def test_dedupe_miss_when_held_block_was_evicted(gen):
    src, dst = pool(), pool()
    prefix = fill_random_sequence(src, "a", 32, gen)
    ex = export_sequence(src, "a", "ra", 1)
    import_sequence(dst, ex.manifest, ex.frames)
    dst.free("ra")
    ex2 = export_sequence(src, "a", "rb", 1, reuse=[0, 1], reuse_block_size=16)
    dst.allocator.evict_cached()
    before, metrics = snapshot(dst), TransferMetrics()
    with pytest.raises(E.DedupeMiss):
        import_sequence(dst, ex2.manifest, ex2.frames, metrics=metrics)
    assert snapshot(dst) == before and metrics.errors["dedupe_miss"] == 1
    assert prefix  # the tokens were used


def _good(gen, n=40):
    src = pool()
    fill_random_sequence(src, "a", n, gen)
    ex = export_sequence(src, "a", "req", 5, config=ExportConfig(chunk_bytes=4096))
    return ex, [bytes(f) for f in ex.frames]


def _wire(ex, **changes):
    d = msgpack.unpackb(encode(ex.manifest), raw=False)
    for k, v in changes.items():
        d[k] = v
    return msgpack.packb(d, use_bin_type=True)


def _flip(frames, i=0, pos=100):
    out = [bytearray(f) for f in frames]
    out[i][pos] ^= 0xFF
    return out


BAD = {
    "truncated frame": (lambda ex, fr: (ex.manifest, [fr[0][:-1]] + fr[1:]), E.FrameSizeError),
    "oversized frame": (lambda ex, fr: (ex.manifest, [fr[0] + b"x"] + fr[1:]), E.FrameSizeError),
    "extra frame": (lambda ex, fr: (ex.manifest, fr + [fr[0]]), E.FrameCountError),
    "missing frame": (lambda ex, fr: (ex.manifest, fr[:-1]), E.FrameCountError),
    "wrong checksum": (lambda ex, fr: (ex.manifest, _flip(fr)), E.ChecksumError),
    "unknown version": (lambda ex, fr: (_wire(ex, v=7), fr), E.ProtocolVersionError),
    "absurd token count": (lambda ex, fr: (_wire(ex, num_tokens=1 << 40), fr), E.LimitExceeded),
    "absurd frame length": (lambda ex, fr: (_wire(ex, frames=[[0, 3, 1 << 50, None]]), fr), E.LimitExceeded),
    "garbage bytes": (lambda ex, fr: (b"\x93\xff\x00garbage", fr), E.MalformedMessage),
    "hashes not of these tokens": (lambda ex, fr: (_wire(ex, block_hashes=b"\x01" * 16), fr),
                                   E.MalformedMessage),
    "frame length not the blocks' size": (lambda ex, fr: (_wire(ex, frames=[[0, 3, 300, b"\0" * 8]]), fr),
                                          E.MalformedMessage),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_leaves_receiver_pool_unchanged(gen, case):
    make, err = BAD[case]
    ex, frames = _good(gen)
    dst, metrics, epochs = pool(), TransferMetrics(), EpochGuard()
    fill_random_sequence(dst, "resident", 20, gen)  # the pool is not empty
    before = snapshot(dst)
    manifest, frames = make(ex, frames)
    with pytest.raises(err):
        import_sequence(dst, manifest, frames, metrics=metrics, epochs=epochs)
    assert snapshot(dst) == before
    dst.check_integrity()
    assert metrics.errors[err.code] == 1 and sum(metrics.errors.values()) == 1
    res = import_sequence(dst, ex.manifest, [bytes(f) for f in ex.frames], epochs=epochs)  # retry works
    assert res.epoch == 5


def test_wrong_fingerprint_refused(gen):
    ex, frames = _good(gen)
    for other in (pool(head_dim=16), pool(dtype="bfloat16"), pool(num_layers=3)):
        before, metrics = snapshot(other), TransferMetrics()
        with pytest.raises(E.FingerprintMismatch):
            import_sequence(other, ex.manifest, frames, metrics=metrics)
        assert snapshot(other) == before and metrics.errors["fingerprint"] == 1


def test_duplicate_and_stale_epochs_refused(gen):
    ex, frames = _good(gen)  # epoch 5
    dst, epochs, metrics = pool(), EpochGuard(), TransferMetrics()
    import_sequence(dst, ex.manifest, frames, epochs=epochs)
    dst.free("req")  # even with the sequence gone, its epoch stays seen
    before = snapshot(dst)
    for epoch in (5, 4):
        m = ex.manifest.__class__(**{**ex.manifest.__dict__, "epoch": epoch})
        with pytest.raises(E.StaleEpoch):
            import_sequence(dst, m, frames, epochs=epochs, metrics=metrics)
    assert snapshot(dst) == before and metrics.errors["stale_epoch"] == 2
    m6 = ex.manifest.__class__(**{**ex.manifest.__dict__, "epoch": 6})
    assert import_sequence(dst, m6, frames, epochs=epochs).epoch == 6
    epochs.begin("other", 1)
    with pytest.raises(E.StaleEpoch, match="in flight"):
        epochs.begin("other", 2)


def test_pool_full_and_sequence_exists(gen):
    ex, frames = _good(gen, n=70)  # 5 blocks
    small, metrics = pool(n=4), TransferMetrics()
    before = snapshot(small)
    with pytest.raises(E.PoolFull):
        import_sequence(small, ex.manifest, frames, metrics=metrics)
    assert snapshot(small) == before and metrics.errors["pool_full"] == 1
    dst = pool()
    import_sequence(dst, ex.manifest, frames)
    before = snapshot(dst)
    with pytest.raises(E.SequenceExists):
        import_sequence(dst, ex.manifest, frames, metrics=metrics)
    assert snapshot(dst) == before


def test_lease_holds_blocks_until_release_or_expiry(gen):
    src = pool()
    fill_random_sequence(src, "a", 40, gen)
    blocks = list(src.table("a").blocks)
    leases = LeaseTable()
    ex = export_sequence(src, "a", "r", 1, config=ExportConfig(lease_s=30))
    leases.add(ex)
    src.free("a")  # the prefill side lets go while the transfer is in flight
    assert all(src.allocator.ref_count(b) == 1 for b in blocks)
    src.check_integrity(extra_refs=leases.extra_refs())
    assert leases.expire(now=ex.deadline - 1) == [] and len(leases) == 1
    assert leases.expire(now=ex.deadline + 1) == [("r", 1)]
    assert all(src.allocator.ref_count(b) == 0 for b in blocks) and len(leases) == 0
    src.check_integrity()
    ex.release()  # idempotent
    src.check_integrity()


# ---- fuzz: mutated manifests and frames never crash, hang or leak -------------------------------
_GEN = torch.Generator().manual_seed(3)
_SRC = pool()
fill_random_sequence(_SRC, "a", 50, _GEN)
_EX = export_sequence(_SRC, "a", "fuzz", 1, config=ExportConfig(chunk_bytes=4096))
_WIRE = msgpack.unpackb(encode(_EX.manifest), raw=False)
_FRAMES = [bytes(f) for f in _EX.frames]
_KEYS = sorted(_WIRE)
values = st.one_of(st.none(), st.booleans(), st.integers(-2, 2**64 - 1), st.floats(), st.text(max_size=8),
                   st.binary(max_size=64), st.lists(st.integers(-1, 300), max_size=5),
                   st.dictionaries(st.text(max_size=4), st.integers(-2**63, 2**64 - 1), max_size=2))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(_KEYS + ["frames.0", "state.token_ids", "state.sampling",
                                                   "fingerprint.block_size"]), values), max_size=3),
       st.integers(0, 3), st.integers(0, 4 * 4096))
def test_fuzz_import_only_typed_errors_and_no_leak(mutations, frame_op, pos):
    d = msgpack.unpackb(msgpack.packb(_WIRE, use_bin_type=True), raw=False)
    for path, value in mutations:
        head, _, tail = path.partition(".")
        if not tail:
            d[head] = value
        elif head == "frames" and isinstance(d["frames"], list) and d["frames"]:
            d["frames"][0] = value
        elif isinstance(d.get(head), dict):
            d[head][tail] = value
    frames = list(_FRAMES)
    if frame_op == 1:
        frames[0] = frames[0][:pos]
    elif frame_op == 2:
        frames = _flip(frames, 0, pos % len(frames[0]))
    elif frame_op == 3:
        frames.append(frames[0][:pos])
    dst = pool(n=16)
    before = snapshot(dst)
    try:
        res = import_sequence(dst, msgpack.packb(d, use_bin_type=True), frames, metrics=TransferMetrics())
    except E.TransferError:
        assert snapshot(dst) == before
    else:
        dst.free(res.seq_id)
    dst.check_integrity()


def test_a_short_pool_asks_its_owner_for_room_once_then_imports():
    """An admitted import that finds the pool short calls `make_room` (a decode worker preempts
    running requests to keep the room it promised) and then lands; without it, PoolFull."""
    gen = torch.Generator().manual_seed(9)
    src, dst = pool(), pool(n=16)
    fill_random_sequence(src, "a", 100, gen)  # 7 blocks
    fill_random_sequence(dst, "running", 150, gen)  # 10 of 16 blocks
    ex = export_sequence(src, "a", "r", 1)
    with pytest.raises(E.PoolFull):
        import_sequence(dst, ex.manifest, ex.frames)
    asked = []

    def make_room(blocks):
        asked.append(blocks)
        dst.free("running")  # what the decode worker's scheduler does by preempting

    res = import_sequence(dst, ex.manifest, ex.frames, make_room=make_room)
    assert asked == [8] and res.new_blocks == 7  # 7 blocks + 1 of growth wanted
    assert torch.equal(kv(dst, "r"), kv(src, "a"))
    ex.release()
