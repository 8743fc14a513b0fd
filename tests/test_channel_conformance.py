"""One conformance suite for every registered KV transport (`transfer.registry.names()`), and for
the test-only in-memory channel loaded by module path (memory_channel.py): the same checks, through
each transport's own sender (`make_sender`) and receiver (a `ZmqReceiver` polled on a thread for
zmq and nixl, the memory channel's endpoint likewise, a `measure.ray_receiver.PoolReceiver` actor
for ray), over real sockets, real Ray actors and real NIXL agents (harness: channel_harness.py).
Receivers sign handshakes with a cluster secret and are reset to a clean pool before each test.

Per channel:
- a migration lands bit-exact at decode block sizes 16, 32 and 8 (the sender's blocks are 16: it
  re-blocks), and a second one sharing the prefix, whole or streamed, reuses the blocks the
  receiver holds;
- a transfer or query no reservation admits (no reservation, another epoch, another sender), a
  stale epoch, an unsigned or wrongly signed hello, and a hello from an incompatible layout or
  another model are refused with the typed error before a block is allocated: the receiver's
  pool is unchanged, the sender's export lease released (over a socket, zmq and nixl, a sender
  without the cluster secret is stopped earlier, in ZeroMQ's CURVE handshake: Unauthenticated);
- a corrupted payload chunk (whole or streamed) and a cut stream (the feed ends without its final
  state, or raises) leave both pools as they were, with nothing left in flight;
- an abort of the request ends its open stream and returns the stream's blocks at once (Ray too:
  the actor's `abort_request`, as the decode worker's Abort calls it);
- a newer epoch of the request ends an older stream still open;
- planted KV (a manifest whose prefix hashes do not match its token ids) is refused.
"""

import dataclasses
from collections import Counter

import pytest
import torch
from channel_harness import SECRET, SENDER, SHAPE, Rig, feed, in_thread, kv_bytes, pool, snapshot

from kvcache.storage import KVLayout
from measure.pools import fill_random_sequence, make_manager
from transfer import errors as E
from transfer import registry
from transfer.blocks import prefix_hashes_at
from transfer.export import ExportConfig, export_sequence
from transfer.lease import LeaseTable
from transfer.wire_messages import DecodeState

pytestmark = pytest.mark.timeout(120)

PLANTED = list(range(300, 364))  # 64 tokens (4 blocks of 16) the receiver must never cache as others' KV


# the registered transports, and one loaded by module path from outside transfer/ (tests/memory_channel.py)
MEMORY = "memory_channel:MemoryChannel"


@pytest.fixture(scope="module", params=registry.names() + (MEMORY,))
def rig(request):
    name = request.param
    if name == "nixl":
        from transfer.channels import nixl_pool

        if not nixl_pool.available():
            pytest.skip("nixl is not installed (pip install 'pdserve[nixl]')")
    if name == "ray":
        request.getfixturevalue("ray_local")  # the shared local Ray
    r = Rig(name)
    try:
        yield r
    finally:
        r.close()


@pytest.fixture(autouse=True)
def _senders_closed(rig):
    yield
    rig.close_senders()


@pytest.fixture
def rx(rig):
    """The rig's receiver of block size 16, with a clean pool and open admission."""
    r = rig.receiver(16)
    r.reset()
    return r


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(11)


# ---- 1. bit-exact landing, re-blocking, dedupe -----------------------------------------------------------
@pytest.mark.parametrize("dst_block", [16, 32, 8])
def test_migrate_lands_bit_exact_and_a_shared_prefix_is_reused(rig, gen, dst_block):
    """Whole (`migrate`) and streamed (`migrate_streamed`) migrations from blocks of 16."""
    rx = rig.receiver(dst_block)
    rx.reset()
    failures = rx.failures()
    src = pool(16)
    tx = rig.sender(src, rx)
    plan = tx.connect()
    assert (plan.dst_block_size, plan.reblock) == (dst_block, dst_block != 16)
    prefix = fill_random_sequence(src, "a", 100, gen)
    leases = LeaseTable()
    ra, rb = rig.request_id("a"), rig.request_id("b")
    ack = tx.migrate(src, "a", ra, 1, leases=leases)
    assert (ack.request_id, ack.new_blocks, ack.reused_blocks) == (ra, -(-100 // dst_block), 0)
    assert rx.kv(ra) == kv_bytes(src, "a")
    # 96 shared tokens: whole receiver blocks the dedupe query finds, not sent again
    fill_random_sequence(src, "b", 120, gen, token_ids=prefix[:96] + list(range(24)))
    ack = tx.migrate(src, "b", rb, 1, leases=leases)
    assert ack.reused_blocks == 96 // dst_block > 0
    assert ack.new_blocks == -(-120 // dst_block) - 96 // dst_block
    assert rx.kv(rb) == kv_bytes(src, "b")
    assert leases.extra_refs() == {}  # acked: the export leases were released
    # streamed (blocks leave as the prompt computes), sharing the same prefix: re-blocked, deduped, exact
    tokens = fill_random_sequence(src, "c", 200, gen, token_ids=prefix[:96] + list(range(1000, 1104)))
    rc = rig.request_id("c")
    final = DecodeState(tokens + [99], {"max_tokens": 9, "temperature": 0.0}, 1)
    ack = tx.migrate_streamed(src, rc, 3, tokens, {"max_tokens": 9}, feed(src.table("c"), 13, final))
    assert (ack.request_id, ack.epoch, ack.reused_blocks) == (rc, 3, 96 // dst_block)
    assert ack.nbytes == (13 - 6) * src.storage.layout.block_bytes  # the 6 held sender blocks stayed home
    assert rx.kv(rc) == kv_bytes(src, "c")
    phases = tx.last_phases
    assert phases["streamed_ms"] > 0 and "exposed_ms" in phases
    assert 0 < phases["overlap_pct"] < 100  # the last group left with the final state
    assert {"prepare_ms", "land_ms", "verify_ms", "commit_ms"} <= set(phases)  # the receiver's
    assert rx.failures() == failures  # nothing failed on the way
    src.check_integrity()
    rx.check()


# ---- 2. refusals before any block is allocated ---------------------------------------------------------
REFUSALS = {  # case -> (the sender's typed error, the receiver's failure code; None: not a failed import)
    "no reservation": (E.NotAdmitted, "refused"),
    "reservation for another epoch": (E.NotAdmitted, "refused"),
    "reservation for another sender": (E.NotAdmitted, "refused"),
    "stale epoch": (E.StaleEpoch, "stale_epoch"),
    "unsigned hello": (E.NotAdmitted, None),
    "wrongly signed hello": (E.NotAdmitted, None),
    "incompatible layout": (E.FingerprintMismatch, "fingerprint"),
    "another model of the same shape": (E.FingerprintMismatch, "fingerprint"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refused_transfer_allocates_nothing(rig, rx, gen, case):
    src = pool(16)
    tokens = fill_random_sequence(src, "a", 40, gen)
    rid = rig.request_id("r")
    tx = rig.sender(src, rx)
    seeded = rig.request_id("seed")  # the receiver caches this prefix: a refused query must not tell
    tx.migrate(src, "a", seeded, 1)
    rx.free(seeded)
    if case == "stale epoch":
        tx.migrate(src, "a", rid, 5)  # epoch 5 committed, then released by the decode side
        rx.free(rid)
    before, before_src, failures = rx.snapshot(), snapshot(src), rx.failures()
    reserved = (rid.rpartition("/")[0], 5, 40, SENDER)
    expect, code = REFUSALS[case]
    refusals = 0  # how many the receiver must have failed
    if case == "no reservation":
        rx.admit([(rig.request_id("other").rpartition("/")[0], 5, 40, SENDER)])
    elif case == "reservation for another epoch":
        rx.admit([reserved[:1] + (6,) + reserved[2:]])
    elif case == "reservation for another sender":
        rx.admit([reserved[:3] + ("prefill-1",)])
    if "hello" in case or expect is E.FingerprintMismatch:
        if "hello" in case:
            bad = rig.sender(src, rx, secret="" if case == "unsigned hello" else SECRET + "-not")
        else:
            field = {"head_dim": 16} if case == "incompatible layout" else {"model": "model-b"}
            bad = rig.sender(make_manager(KVLayout(block_size=16, **{**SHAPE, **field}), 8), rx)
        if "hello" in case and rig.curve:  # a socket keyed with the cluster secret (CURVE):
            with pytest.raises(E.Unauthenticated, match="ZeroMQ handshake"):  # stopped inside libzmq
                bad.connect()
        else:
            with pytest.raises(expect) as info:
                bad.connect()
            assert info.value.remote
            refusals += 1
        if case == "another model of the same shape":
            assert "model" in str(info.value)  # names the field
    else:
        if case in ("no reservation", "reservation for another sender"):
            with pytest.raises(E.NotAdmitted) as info:  # a query carries no epoch
                tx.query(rid, tokens)
            assert "refused" in str(info.value) and rid not in str(info.value)  # nothing echoed
            refusals += 1
        epochs = (5, 4) if case == "stale epoch" else (5,)  # the committed epoch again, and an older one
        for epoch in epochs:
            leases = LeaseTable()
            with pytest.raises(expect) as info:
                tx.migrate(src, "a", rid, epoch, dedupe=False, leases=leases)
            assert info.value.remote and leases.extra_refs() == {}  # the nack released the export's lease
            refusals += 1
    assert rx.snapshot() == before and rx.in_flight() == {}
    assert snapshot(src) == before_src
    if code is not None:  # the receiver failed it with the same typed error
        assert rx.failures() - failures == Counter({code: refusals})
    # the control: the transfer the receiver expects is admitted, and its dedupe hit is real
    if case != "stale epoch":
        rx.admit([reserved])
        ack = tx.migrate(src, "a", rid, 5)
    else:
        ack = tx.migrate(src, "a", rid, 6)
    assert ack.reused_blocks == 2 and rx.kv(rid) == kv_bytes(src, "a")


# ---- 3. corrupted chunks and cut streams leave both pools as they were ---------------------------------
FAILURES = ["corrupted chunk", "stream cut before its final state", "feed raises mid-stream",
            "streamed chunk corrupted"]


@pytest.mark.parametrize("case", FAILURES)
def test_a_failed_transfer_leaves_both_pools_as_they_were(rig, rx, gen, case):
    src = pool(16)
    fill_random_sequence(src, "resident", 30, gen)  # the sender's pool holds more than the migrating sequence
    tokens = fill_random_sequence(src, "a", 200, gen)  # 13 blocks of 16
    t = src.table("a")
    rid = rig.request_id("f")
    tx = rig.sender(src, rx)
    tx.connect()
    before, before_src, failures = rx.snapshot(), snapshot(src), rx.failures()
    final = DecodeState(tokens + [5], {"max_tokens": 4}, 1)
    leases = LeaseTable()
    code = "checksum" if "corrupted" in case else "closed"
    if case == "corrupted chunk":
        tx.faults.arm("flip_payload")
        with pytest.raises(E.ChecksumError) as info:
            tx.migrate(src, "a", rid, 1, leases=leases)
        assert info.value.remote and tx.faults.injected["flip_payload"] == 1
    elif case == "streamed chunk corrupted":
        tx.faults.arm("flip_payload")
        with pytest.raises(E.ChecksumError):
            tx.migrate_streamed(src, rid, 1, tokens, {"max_tokens": 4}, feed(t, 13, final))
        assert tx.faults.injected["flip_payload"] == 1
    elif case == "stream cut before its final state":
        with pytest.raises(E.TransportClosed):
            tx.migrate_streamed(src, rid, 1, tokens, {"max_tokens": 4}, feed(t, 13, final, stop_after=8))
    else:
        with pytest.raises(RuntimeError, match="prefill failed"):
            tx.migrate_streamed(src, rid, 1, tokens, {"max_tokens": 4}, feed(t, 13, final, fail_after=8))
    assert leases.extra_refs() == {} and snapshot(src) == before_src  # no reference leaked on the sender
    src.check_integrity()
    # the receiver failed it with the typed error (a cancelled stream: TransportClosed), bounded
    assert rx.settle(failures, code) == ({}, Counter({code: 1}))
    assert rx.snapshot() == before
    rx.check()
    # the same connection still works: the sequence lands whole and intact
    ok = rig.request_id("ok")
    tx.migrate_streamed(src, ok, 1, tokens, {"max_tokens": 4}, feed(t, 13, final))
    assert rx.kv(ok) == kv_bytes(src, "a")


# ---- 4, 5. an open stream ended by an abort, or by a newer epoch ---------------------------------------
def _open_stream(rig, rx, src, rid, epoch, tokens, final):
    """A streamed migration on a thread whose feed sends its first group of blocks and then waits for
    `thaw` (the prefill froze) before the rest: -> (sender, thread, outcome, thaw), once the receiver
    holds the stream in flight."""
    import threading

    thaw = threading.Event()
    t = src.table("a")
    tx = rig.sender(src, rx, transfer_timeout_s=15.0)
    tx.connect()
    th, outcome = in_thread(tx.migrate_streamed, src, rid, epoch, tokens, {"max_tokens": 4},
                            feed(t, 13, final, hold=lambda: thaw.wait(30)))
    held = rx.wait_in_flight(lambda f: rid in f)
    assert list(held) == [rid] and len(set(held[rid])) == 13  # every block reserved at the offer
    return tx, th, outcome, thaw


def test_an_abort_returns_an_open_streams_blocks_at_once(rig, rx, gen):
    src = pool(16)
    tokens = fill_random_sequence(src, "a", 200, gen)
    rid = rig.request_id("abort")
    before, before_src = rx.snapshot(), snapshot(src)
    tx, th, outcome, thaw = _open_stream(rig, rx, src, rid, 1, tokens, DecodeState(tokens + [5], {}, 1))
    try:
        assert rx.snapshot() != before
        assert rx.abort_request(rid.rpartition("/")[0]) == 1
        assert rx.in_flight() == {} and rx.snapshot() == before  # returned now, not at the idle timeout
        assert rx.abort_request(rid.rpartition("/")[0]) == 0
    finally:
        thaw.set()
        th.join(30)
    assert not th.is_alive()
    assert isinstance(outcome.get("error"), E.TransferError), outcome  # the sender learns it ended
    assert rx.snapshot() == before and snapshot(src) == before_src
    rx.check()


def test_a_newer_epoch_ends_an_older_open_stream(rig, rx, gen):
    src = pool(16)
    tokens = fill_random_sequence(src, "a", 200, gen)
    t = src.table("a")
    rid = rig.request_id("rerun")
    before = rx.snapshot()
    final = DecodeState(tokens + [5], {"max_tokens": 4}, 1)
    frozen, th, outcome, thaw = _open_stream(rig, rx, src, rid, 1, tokens, final)
    try:
        rerun = rig.sender(src, rx)  # the coordinator re-ran the request: another connection, epoch 2
        ack = rerun.migrate_streamed(src, rid, 2, tokens, {"max_tokens": 4}, feed(t, 13, final))
        assert (ack.request_id, ack.epoch) == (rid, 2)
        assert rx.in_flight() == {}  # the old stream ended
        after = rx.snapshot()
        assert after[2] == 13 and after[3] == [rid]  # only the rerun's blocks are held: the old ones are back
        assert rx.kv(rid) == kv_bytes(src, "a")
    finally:
        thaw.set()
        th.join(30)
    assert not th.is_alive()
    assert isinstance(outcome.get("error"), E.TransferError), outcome  # the frozen sender learns it too
    rx.free(rid, uncache=True)
    assert rx.snapshot() == before
    rx.check()


# ---- 6. planted KV -----------------------------------------------------------------------------------
@pytest.mark.parametrize("lie", ["hashes of other tokens", "token ids of other tokens"])
def test_planted_kv_is_refused(rig, rx, gen, lie):
    """KV offered under prefix hashes its token ids do not have: adopted, it would be served to any
    later prompt with those hashes (the planted prefix) as if it were that prompt's KV."""
    src = pool(16)
    fill_random_sequence(src, "a", 64, gen)
    tx = rig.sender(src, rx)
    tx.connect()
    rid = rig.request_id("plant")
    before, before_src = rx.snapshot(), snapshot(src)
    cfg = tx.config
    ex = export_sequence(src, "a", rid, 1, config=ExportConfig(chunk_bytes=cfg.chunk_bytes,
                                                               checksum_mode=cfg.checksum_mode))
    m = ex.manifest
    if lie == "hashes of other tokens":
        ex.manifest = dataclasses.replace(m, block_hashes=tuple(prefix_hashes_at(PLANTED, 16, m.extra_key)))
    else:
        ex.manifest = dataclasses.replace(m, state=dataclasses.replace(m.state, token_ids=list(PLANTED)))
    with pytest.raises(E.MalformedMessage) as info:
        tx.send(ex)
    assert info.value.remote and ex.released
    assert rx.snapshot() == before and rx.in_flight() == {} and snapshot(src) == before_src
    assert tx.query(rig.request_id("probe"), PLANTED) == []  # nothing cached under the planted prefix
