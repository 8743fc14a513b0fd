"""Streamed migration (transfer.stream_export + ZmqSender.migrate_streamed): the sequence is
offered before its prompt finished computing, its blocks follow as they complete, and a Final
message with the decode state closes it. In process against a real ZeroMQ receiver: the landed
KV equals the sender's, at equal and unequal block sizes, and the closing state is the one
adopted; a final state that does not continue the offer is refused whole and leaves both pools
as they were. On a local Ray cluster whose step budget splits prompts into chunks, over zmq and
ray: greedy tokens through streamed migrations equal the local engine's. What every transport
must do alike (a cut or corrupted stream refused whole, an abort or a newer epoch ending an
open stream) is in test_channel_conformance.py."""

import time

import pytest
import torch
from zmq_helpers import Served, kv_bytes, pool, snapshot

from measure.pools import fill_random_sequence
from transfer import errors as E
from transfer.channels.zmq_channel import ZmqSender
from transfer.transport import TransportConfig
from transfer.wire_messages import DecodeState


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(3)


def _feed(table, n_blocks, final, step=4, delay=0.02):
    """Blocks in groups of `step` as prefill chunks complete; the last group goes with the state."""
    for k in range(0, n_blocks - step, step):
        yield [(i, table.blocks[i]) for i in range(k, min(n_blocks, k + step))]
        time.sleep(delay)  # the next prefill chunk computes
    k = max(0, (n_blocks - 1) // step * step)
    yield [(i, table.blocks[i]) for i in range(k, n_blocks)], final


@pytest.mark.parametrize("dst_block_size", [16, 32, 8])
def test_streamed_kv_equals_the_sender_and_the_final_state_is_adopted(gen, dst_block_size):
    src, dst = pool(), pool(block_size=dst_block_size, num_blocks=128)
    fill_random_sequence(src, "a", 200, gen)
    t = src.table("a")
    served = Served(dst, auto_free=True)
    cfg = TransportConfig(address=served.rx.address, chunk_bytes=4096)
    tx = ZmqSender(src.storage.layout.fingerprint(), cfg)
    tokens = t.token_ids[:200]
    try:
        final = DecodeState(tokens + [99], {"max_tokens": 9, "temperature": 0.0}, 1)
        ack = tx.migrate_streamed(src, "r/0", 3, tokens, {"max_tokens": 9}, _feed(t, 13, final))
        got = served.next()
        assert (got.request_id, got.epoch, ack.nbytes) == ("r/0", 3, 13 * src.storage.layout.block_bytes)
        # the closing state, not the offer's provisional one (sampling filled in with its defaults)
        assert (got.state.token_ids, got.state.num_generated, got.state.sampling["max_tokens"]) == \
            (final.token_ids, 1, 9)
        assert torch.equal(served.kv["r/0"], kv_bytes(src, "a"))
        assert tx.last_phases["streamed_ms"] > 0 and "exposed_ms" in tx.last_phases
        assert 0 < tx.last_phases["overlap_pct"] < 100  # the last group left with the final state
    finally:
        tx.close()
        served.stop()


@pytest.mark.parametrize("case", ["final does not continue"])  # cut and corrupted: test_channel_conformance
def test_a_broken_stream_is_refused_whole(gen, case):
    src, dst = pool(), pool()
    fill_random_sequence(dst, "resident", 30, gen)
    fill_random_sequence(src, "a", 200, gen)
    before_src, before_dst = snapshot(src), snapshot(dst)
    t = src.table("a")
    tokens = t.token_ids[:200]
    served = Served(dst, idle_timeout_s=2.0)
    cfg = TransportConfig(address=served.rx.address, chunk_bytes=4096)
    tx = ZmqSender(src.storage.layout.fingerprint(), cfg)
    final = DecodeState(tokens + [5], {"max_tokens": 4}, 1)
    try:
        wrong = DecodeState([1] + tokens[1:] + [5], {"max_tokens": 4}, 1)
        with pytest.raises(E.MalformedMessage):
            tx.migrate_streamed(src, "r/0", 1, tokens, {"max_tokens": 4}, _feed(t, 13, wrong))
        assert isinstance(served.next(), E.MalformedMessage)
        assert snapshot(dst) == before_dst and snapshot(src) == before_src
        # the connection still works: a whole stream of the same sequence lands intact
        tx.migrate_streamed(src, "ok/0", 1, tokens, {"max_tokens": 4}, _feed(t, 13, final, delay=0))
        assert served.next().request_id == "ok/0"
    finally:
        tx.close()
        served.stop()
    assert torch.equal(kv_bytes(dst, "ok/0"), kv_bytes(src, "a"))
    dst.free("ok/0")
    dst.allocator.evict_cached()
    assert snapshot(dst) == before_dst
    dst.check_integrity()


@pytest.mark.parametrize("transport", ["zmq", "ray"])
def test_cluster_greedy_tokens_through_streamed_migrations_equal_the_local_engine(ray_local, local_engine,
                                                                                 transport):
    """A step budget of 32 tokens splits every prompt into prefill chunks, so each request's KV
    leaves in pieces while its prompt computes (re-blocked 16 -> 32 on the way), over either
    transport."""
    pytest.importorskip("ray")
    import cluster_client as cc

    from coordinator.cluster import ClusterConfig
    from deploy.launch import ClusterServer
    from engine.sampling import SamplingParams

    prompts = [list(range(1, 101)), list(range(200, 350)), [7, 8, 9] * 40]
    config = ClusterConfig(prefill=1, decode=1, transport=transport, block_size=16, decode_block_size=32,
                           num_blocks=256, engine={"scheduler": {"max_num_batched_tokens": 32}})
    want = cc.reference(local_engine, prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    srv = ClusterServer(config)
    try:
        srv.start()
        for prompt, ref in zip(prompts, want):
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            got = cc.complete(srv.port, body)
            assert [c["token_ids"] for c in got["choices"]] == ref
            migration = got["pdserve"]["backend"]["migration"]
            assert migration["transport"] == transport
            phases = migration["phases"]
            assert phases["streamed_ms"] > 0 and "exposed_ms" in phases  # it went out in pieces
            assert {"land_ms", "verify_ms", "commit_ms"} <= set(phases)  # the receiver's
        ws = cc.poll_workers(srv.port, lambda ws: all(w["used_blocks"] == 0 for w in ws.values()))
        prefill = [w for w in ws.values() if w["role"] == "prefill"]
        assert [(w["streamed_migrations"], w["stream_fallbacks"]) for w in prefill] == [(3, 0)]
        assert all(w["used_blocks"] == 0 for w in ws.values())  # pinned and reserved blocks all returned
    finally:
        srv.stop()
