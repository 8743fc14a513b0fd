"""Streamed migration over the Ray transport (transfer.channels.ray_channel, transfer.channels.ray_receiver):
in process against a real receiving actor (measure.ray_receiver.PoolReceiver, the decode worker's
endpoint over a synthetic pool): a lost offer (its final is nacked) or a final that does not continue
the offer is refused whole and leaves both pools as they were. A call's headers are strict. A
decode worker in process admits an offer only under its reservation, reports the stream's blocks
as the request's, and returns them on an Abort. What every transport must do alike (streamed KV equal
to the sender's at several block sizes, a cut or corrupted stream refused whole, an abort or a
newer epoch ending an open stream) is in test_channel_conformance.py; the cluster run over
transport="ray" is in test_streamed_migration.py, parametrized by transport."""

import time

import pytest
import torch
from zmq_helpers import pool, snapshot

from measure.pools import fill_random_sequence, kv_digest
from transfer import errors as E
from transfer.faults import Faults
from transfer.stream_export import StreamedExport
from transfer.transport import TransportConfig
from transfer.wire_messages import DecodeState

ray = pytest.importorskip("ray")
POOL = ("free", "cached", "used", "tables")


@pytest.fixture
def actors(ray_local):
    """Receiving actors over a synthetic pool (layout of zmq_helpers.pool), killed afterwards."""
    from measure.ray_receiver import PoolReceiver

    made = []

    def make(block_size, n=128, **config):
        made.append(ray.remote(num_cpus=0.1)(PoolReceiver).remote((2, 2, 8, block_size, "float16"), n,
                                                                  TransportConfig(**config)))
        return made[-1]

    yield make
    for a in made:
        ray.kill(a)


def _sender(src, recv):
    from transfer.channels.ray_channel import RaySender

    tx = RaySender(src.storage.layout.fingerprint(), recv, TransportConfig(chunk_bytes=4096))
    tx.connect(timeout=60)
    return tx


def _pool_state(recv):
    stats = ray.get(recv.stats.remote())  # runs check_integrity inside the actor
    return {k: stats[k] for k in POOL}, stats["metrics"]["errors"]


def _feed(table, n_blocks, final, step=4, delay=0.02, pause=None):
    """Blocks in groups of `step` as prefill chunks complete; the last group goes with the state.
    pause(): called after the first group (the prefill stalls there)."""
    for k in range(0, n_blocks - step, step):
        yield [(i, table.blocks[i]) for i in range(k, min(n_blocks, k + step))]
        if pause is not None and k == 0:
            pause()
        time.sleep(delay)  # the next prefill chunk computes
    k = max(0, (n_blocks - 1) // step * step)
    yield [(i, table.blocks[i]) for i in range(k, n_blocks)], final


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(11)


@pytest.mark.parametrize("case", ["offer lost", "final does not continue"])
def test_a_broken_ray_stream_is_refused_whole(actors, gen, case):
    src, recv = pool(num_blocks=64), actors(16)
    fill_random_sequence(src, "a", 200, gen)
    t = src.table("a")
    tokens = t.token_ids[:200]
    tx = _sender(src, recv)
    before_src, (before_dst, _) = snapshot(src), _pool_state(recv)
    final = DecodeState(tokens + [5], {"max_tokens": 4}, 1)
    if case == "offer lost":  # its chunks are strays to the receiver, its final is answered by a nack
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
    # the connection still works: a whole stream of the same sequence lands intact
    tx.migrate_streamed(src, "ok/0", 1, tokens, {"max_tokens": 4}, _feed(t, 13, final, delay=0), timeout=60)
    assert ray.get(recv.digest.remote("ok/0")) == kv_digest(src, "a")
    ray.get(recv.free.remote("ok/0"))
    assert _pool_state(recv)[0] == before_dst


def test_call_headers_are_strict():
    import msgpack

    from transfer.channels.ray_receiver import decode_headers

    assert decode_headers(msgpack.packb([b"H", b"M" + bytes(8)])) == [b"H", b"M" + bytes(8)]
    for bad in (b"\xc1", msgpack.packb({"a": 1}), msgpack.packb(["H"]), msgpack.packb([b"x" * 65]),
                msgpack.packb([b"H"] * 5)):
        with pytest.raises(E.MalformedMessage):
            decode_headers(bad, limit=4)


def _call(w, *messages) -> list:
    """One Ray channel call to the in-process worker: its answers as (header, decoded body)."""
    import msgpack

    from transfer.wire_codec import decode

    replies = msgpack.unpackb(w.kv("c", msgpack.packb([h for h, _ in messages]), *[b for _, b in messages]))
    return [(h, decode(b)) for h, b in replies]


def test_decode_worker_admits_a_stream_only_under_its_reservation_and_an_abort_ends_it():
    """The decode worker in process (its `kv` method called directly, no Ray): an offer without a
    reservation is refused before a block is allocated; under one, every block is reserved at the
    offer and reported as held by the request; an Abort returns them at once, and the stream's
    final is refused."""
    from worker_harness import in_process

    from decode_worker.worker import DecodeWorker
    from kvcache.storage import KVLayout
    from measure.pools import make_manager
    from protocol.codec import decode as decode_command
    from protocol.codec import encode as encode_command
    from protocol.messages import Abort, Reserve
    from transfer.transport import make_hello
    from transfer.wire import TOKEN
    from transfer.wire_codec import encode, seal
    from transfer.wire_messages import Final, HelloReply, Nack

    with in_process(DecodeWorker, {"name": "decode-rs", "transport": "ray", "engine": {"num_blocks": 32}}) \
            as (w, _):
        fp = w.engine.storage.layout.fingerprint()
        layout = KVLayout(fp["num_layers"], fp["num_kv_heads"], fp["head_dim"], fp["block_size"], fp["dtype"],
                          fp["model"])
        src = make_manager(layout, 16)
        tokens = list(range(1, 41))
        fill_random_sequence(src, "a", 40, torch.Generator().manual_seed(2), tokens)
        hello = encode(make_hello(layout.fingerprint(), TransportConfig(peer_name="prefill-0")))
        [(header, reply)] = _call(w, (b"H", hello))
        assert header == b"h" and isinstance(reply, HelloReply)
        sx = StreamedExport(src, "r/0", 3, tokens, {"max_tokens": 4})
        offer = seal(encode(sx.manifest))
        used = w.engine.kv.usage()["used_blocks"]
        [(header, refused)] = _call(w, (TOKEN.pack(b"W", 1), offer))
        assert header == TOKEN.pack(b"A", 1) and isinstance(refused, Nack) and refused.code == "refused"
        assert w.engine.kv.usage()["used_blocks"] == used
        assert decode_command(w.command(encode_command(Reserve("r", 3, 41, 1, "prefill-0")))).granted
        assert _call(w, (TOKEN.pack(b"W", 2), offer)) == []  # admitted: no answer until its final
        assert w.engine.kv.usage()["used_blocks"] == used + 3  # 40 tokens in blocks of 16
        assert w.loop.call(Abort("none")) is None  # a no-op, answered on the loop thread after the offer
        assert w.handler.holdings() == {"r": 3}
        w.command(encode_command(Abort("r")))
        deadline = time.monotonic() + 10
        while w.engine.kv.usage()["used_blocks"] != used and time.monotonic() < deadline:
            time.sleep(0.02)
        assert w.engine.kv.usage()["used_blocks"] == used and w.handler.receiver.in_flight() == {}
        final = seal(encode(Final("r/0", 3, DecodeState(tokens + [5], {"max_tokens": 4}, 1))))
        answers = _call(w, (TOKEN.pack(b"F", 2), final))  # the abort's nack; the final itself is stray
        assert answers and all(isinstance(body, Nack) and body.code == "closed" for _, body in answers)
