"""Streamed migration over the Ray transport (transfer.ray_stream, transfer.ray_stream_receiver):
in process against a real receiving actor (bench.ray_receiver.PoolReceiver, the decode worker's
endpoint over a synthetic pool): the landed KV equals the sender's at equal and unequal block
sizes; a stream cut after its first chunk, a corrupted second chunk, a lost offer or a final
that does not continue the offer is refused whole and leaves both pools as they were; a stream
that goes idle is expired by the receiver with every reserved block returned. The header schema
is strict. A decode worker in process admits an offer only under its reservation, reports the
stream's blocks as the request's, and returns them on an Abort. (The cluster run over
transport="ray" is in test_streamed_migration.py, parametrized by transport.)"""

import time

import pytest
import torch
from zmq_helpers import pool, snapshot

from bench.pools import fill_random_sequence, kv_digest
from transfer import errors as E
from transfer.faults import Faults
from transfer.messages import DecodeState
from transfer.ray_wire import BLOCKS, OFFER, StreamHeader, decode_header, encode_header
from transfer.schema import Limits
from transfer.stream_export import StreamedExport
from transfer.transport import TransportConfig

ray = pytest.importorskip("ray")
POOL = ("free", "cached", "used", "tables")


@pytest.fixture
def actors(ray_local):
    """Receiving actors over a synthetic pool (layout of zmq_helpers.pool), killed afterwards."""
    from bench.ray_receiver import PoolReceiver

    made = []

    def make(block_size, n=128, **config):
        made.append(ray.remote(num_cpus=0.1)(PoolReceiver).remote((2, 2, 8, block_size, "float16"), n,
                                                                  TransportConfig(**config)))
        return made[-1]

    yield make
    for a in made:
        ray.kill(a)


def _sender(src, recv):
    from transfer.ray_channel import RaySender

    tx = RaySender(src.storage.layout.fingerprint(), recv, TransportConfig(chunk_bytes=4096))
    tx.connect(timeout=60)
    return tx


def _pool_state(recv):
    stats = ray.get(recv.stats.remote())  # runs check_integrity inside the actor
    return {k: stats[k] for k in POOL}, stats["metrics"]["errors"]


def _feed(table, n_blocks, final, step=4, delay=0.02, stop_after=None, pause=None):
    """Blocks in groups of `step` as prefill chunks complete; the last group goes with the state.
    pause(): called after the first group (the prefill stalls there)."""
    for k in range(0, n_blocks - step, step):
        if stop_after is not None and k >= stop_after:
            return  # the feed ends without a final state: a cancelled stream
        yield [(i, table.blocks[i]) for i in range(k, min(n_blocks, k + step))]
        if pause is not None and k == 0:
            pause()
        time.sleep(delay)  # the next prefill chunk computes
    k = max(0, (n_blocks - 1) // step * step)
    yield [(i, table.blocks[i]) for i in range(k, n_blocks)], final


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(11)


@pytest.mark.parametrize("dst_block_size", [16, 32, 8])
def test_ray_streamed_kv_equals_the_sender(actors, gen, dst_block_size):
    src, recv = pool(num_blocks=64), actors(dst_block_size)
    fill_random_sequence(src, "a", 200, gen)
    t = src.table("a")
    tokens = t.token_ids[:200]
    tx = _sender(src, recv)
    final = DecodeState(tokens + [99], {"max_tokens": 9, "temperature": 0.0}, 1)
    ack = tx.migrate_streamed(src, "r/0", 3, tokens, {"max_tokens": 9}, _feed(t, 13, final), timeout=60)
    assert (ack.request_id, ack.epoch, ack.nbytes) == ("r/0", 3, 13 * src.storage.layout.block_bytes)
    assert ray.get(recv.digest.remote("r/0")) == kv_digest(src, "a")
    assert tx.last_phases["streamed_ms"] > 0 and "exposed_ms" in tx.last_phases
    assert 0 < tx.last_phases["overlap_pct"] < 100  # the last group left with the final state
    assert {"prepare_ms", "land_ms", "verify_ms", "commit_ms"} <= set(tx.last_phases)
    state, errors = _pool_state(recv)
    assert state["tables"] == 1 and errors == {}
    # a prompt sharing 192 tokens reuses the prefix the receiver holds (dedupe); the rest lands intact
    fill_random_sequence(src, "b", 220, gen, token_ids=tokens[:192] + list(range(28)))
    tb = src.table("b")
    more = tb.token_ids[:220]
    ack = tx.migrate_streamed(src, "s/0", 1, more, {"max_tokens": 9},
                              _feed(tb, 14, DecodeState(more + [1], {}, 1), delay=0), timeout=60)
    assert ack.reused_blocks == 192 // dst_block_size
    assert ray.get(recv.digest.remote("s/0")) == kv_digest(src, "b")
    src.check_integrity()


def _flip_second_chunk(monkeypatch):
    real = StreamedExport.chunks

    def flipped(self, blocks):
        for key, view in real(self, blocks):
            if key[0] == 1:  # the second chunk: its bytes differ from what was hashed
                data = bytearray(view)
                data[7] ^= 1
                view = bytes(data)
            yield key, view

    monkeypatch.setattr(StreamedExport, "chunks", flipped)


@pytest.mark.parametrize("case", ["cut after the first chunk", "second chunk corrupted", "offer lost",
                                  "final does not continue"])
def test_a_broken_ray_stream_is_refused_whole(actors, gen, monkeypatch, case):
    src, recv = pool(num_blocks=64), actors(16)
    fill_random_sequence(src, "a", 200, gen)
    t = src.table("a")
    tokens = t.token_ids[:200]
    tx = _sender(src, recv)
    before_src, (before_dst, _) = snapshot(src), _pool_state(recv)
    final = DecodeState(tokens + [5], {"max_tokens": 4}, 1)
    if case == "cut after the first chunk":
        want, code = E.TransportClosed, "closed"  # the sender's cancel call aborts the receiver's stream
        feed = _feed(t, 13, final, stop_after=4)
    elif case == "second chunk corrupted":
        want, code, feed = E.ChecksumError, "checksum", _feed(t, 13, final)
        _flip_second_chunk(monkeypatch)
    elif case == "offer lost":
        want, code, feed = E.TransportClosed, "closed", _feed(t, 13, final)
        tx.faults = Faults()
        tx.faults.arm("drop_control")
    else:
        wrong = DecodeState([1] + tokens[1:] + [5], {"max_tokens": 4}, 1)
        want, code, feed = E.MalformedMessage, "malformed", _feed(t, 13, wrong)
    with pytest.raises(want):
        tx.migrate_streamed(src, "r/0", 1, tokens, {"max_tokens": 4}, feed, timeout=60)
    after_dst, errors = _pool_state(recv)  # ordered after the cancel: same caller, one-threaded actor
    assert after_dst == before_dst and snapshot(src) == before_src
    assert errors == {code: 1}
    assert ray.get(recv.in_flight.remote()) == {}
    monkeypatch.undo()
    # the connection still works: a whole stream of the same sequence lands intact
    tx.migrate_streamed(src, "ok/0", 1, tokens, {"max_tokens": 4}, _feed(t, 13, final, delay=0), timeout=60)
    assert ray.get(recv.digest.remote("ok/0")) == kv_digest(src, "a")
    ray.get(recv.free.remote("ok/0"))
    assert _pool_state(recv)[0] == before_dst


def test_an_idle_ray_stream_expires_and_returns_its_blocks(actors, gen):
    """The prefill worker goes silent after its first chunk: the receiver's expiry (the decode
    loop calls it every iteration) aborts the stream and every reserved block comes back; the
    sender, when it speaks again, gets the receiver's verdict."""
    src, recv = pool(num_blocks=64), actors(16, idle_timeout_s=0.3)
    fill_random_sequence(src, "a", 200, gen)
    t = src.table("a")
    tokens = t.token_ids[:200]
    tx = _sender(src, recv)
    before, _ = _pool_state(recv)
    seen = {}

    def stall():
        seen["reserved"] = ray.get(recv.in_flight.remote())  # (stats would fail its integrity check now)
        time.sleep(0.6)
        seen["expired"] = ray.get(recv.expire_streams.remote())
        seen["after"] = _pool_state(recv)

    final = DecodeState(tokens + [5], {"max_tokens": 4}, 1)
    with pytest.raises(E.TransferTimeout) as info:
        tx.migrate_streamed(src, "r/0", 1, tokens, {"max_tokens": 4}, _feed(t, 13, final, pause=stall),
                            timeout=60)
    assert info.value.remote  # the receiver's verdict, not a local wait
    assert len(set(seen["reserved"]["r/0"])) == 13  # every block reserved at the offer
    assert seen["expired"] == 1 and seen["after"] == (before, {"timeout": 1})
    assert ray.get(recv.in_flight.remote()) == {}


def test_stream_header_schema_is_strict():
    limits = Limits()
    h = StreamHeader(BLOCKS, 3, 1, (0, 1), (0, 0), (7, 2**64 - 1))
    assert decode_header(encode_header(h), limits, BLOCKS) == h
    import msgpack

    wire = h.to_wire()
    for bad in ({**wire, "extra": 1}, {**wire, "sums": wire["sums"][:8]}, {**wire, "kind": "ray_nope"},
                {**wire, "token": 0}, {**wire, "seq": "1"},
                {**StreamHeader(OFFER, 3).to_wire(), "frames": wire["frames"], "chunks": wire["chunks"],
                 "sums": wire["sums"]}):
        with pytest.raises(E.MalformedMessage):
            decode_header(msgpack.packb(bad), limits)
    with pytest.raises(E.MalformedMessage):
        decode_header(encode_header(h), limits, OFFER)  # not the kind this call takes


def test_decode_worker_admits_a_stream_only_under_its_reservation_and_an_abort_ends_it():
    """The decode worker in process (its actor methods called directly, no Ray): an offer without a
    reservation is refused before a block is allocated; under one, every block is reserved at the
    offer and reported as held by the request; an Abort returns them at once, and the stream's
    next call is refused."""
    from worker_harness import in_process

    from bench.pools import make_manager
    from decode_worker.worker import DecodeWorker
    from kvcache.storage import KVLayout
    from protocol.codec import decode as decode_command
    from protocol.codec import encode as encode_command
    from protocol.messages import Abort, Reserve
    from transfer.codec import decode, encode, seal
    from transfer.messages import HelloReply, Nack
    from transfer.ray_wire import OK
    from transfer.transport import make_hello

    with in_process(DecodeWorker, {"name": "decode-rs", "transport": "ray", "engine": {"num_blocks": 32}}) \
            as (w, _):
        fp = w.engine.storage.layout.fingerprint()
        layout = KVLayout(fp["num_layers"], fp["num_kv_heads"], fp["head_dim"], fp["block_size"], fp["dtype"],
                          fp["model"])
        src = make_manager(layout, 16)
        tokens = list(range(1, 41))
        fill_random_sequence(src, "a", 40, torch.Generator().manual_seed(2), tokens)
        hello = encode(make_hello(layout.fingerprint(), TransportConfig(peer_name="prefill-0")))
        assert isinstance(decode(w.kv("hello", "c", hello)), HelloReply)
        offer = seal(encode(StreamedExport(src, "r/0", 3, tokens, {"max_tokens": 4}).manifest))
        used = w.engine.kv.usage()["used_blocks"]
        refused = decode(w.kv("offer", "c", encode_header(StreamHeader(OFFER, 1)), offer))
        assert isinstance(refused, Nack) and refused.code == "refused"
        assert w.engine.kv.usage()["used_blocks"] == used
        assert decode_command(w.command(encode_command(Reserve("r", 3, 41, 1, "prefill-0")))).granted
        reply = decode_header(w.kv("offer", "c", encode_header(StreamHeader(OFFER, 2)), offer), Limits())
        assert reply.kind == OK
        assert w.engine.kv.usage()["used_blocks"] == used + 3  # 40 tokens in blocks of 16
        assert w.loop.call(Abort("none")) is None  # a no-op, answered on the loop thread after the offer
        assert w.handler.holdings() == {"r": 3}
        w.command(encode_command(Abort("r")))
        deadline = time.monotonic() + 10
        while w.engine.kv.usage()["used_blocks"] != used and time.monotonic() < deadline:
            time.sleep(0.02)
        assert w.engine.kv.usage()["used_blocks"] == used and w.handler.receiver.in_flight() == {}
        header = StreamHeader(BLOCKS, 2, 0, (0,), (0,), (0,))
        late = decode(w.kv("blocks", "c", encode_header(header), bytes(layout.block_bytes)))
        assert isinstance(late, Nack) and late.code == "closed"
