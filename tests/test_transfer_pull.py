"""Payloads the receiver reads from the sender's pool (transfer.pull) over the ZeroMQ control
channel: a same-node /dev/shm pool offered after the hello, landed bit-exact with no byte on the
wire; an offer the receiver cannot open is declined and bytes are pushed as before; offsets
outside the offered pool, or offsets on a connection whose pool was never accepted, fail the
transfer with the receiver's pool exactly as it was; checksums sent after the offsets ("K", hashed
while the receiver reads) are checked against what landed, staged or not."""

import contextlib

import pytest
import torch

from kvcache.storage import KVLayout
from measure.pools import fill_random_sequence, make_manager
from tests.zmq_helpers import SHAPE, Served, kv_bytes, snapshot
from transfer import errors as E
from transfer.channels.zmq_channel import ZmqSender
from transfer.checksum import checksum
from transfer.export import ExportConfig, export_sequence
from transfer.pull import ShmAdvert, encode_offsets
from transfer.transport import TransportConfig
from transfer.wire import TOKEN
from transfer.wire_codec import encode, seal
from transfer.wire_messages import PoolOffer

LAYOUT = KVLayout(block_size=16, **SHAPE)


def _source(tokens=70, seed=1):
    src = make_manager(LAYOUT, 64, shm=True)
    fill_random_sequence(src, "a", tokens, torch.Generator().manual_seed(seed), list(range(1, tokens + 1)))
    return src


def _sender(src, address, advert="shm", **config):
    config = {"inline_bytes": 0, **config}
    cfg = TransportConfig(address=address, checksum_mode="manifest", **config)
    return ZmqSender(src.storage.layout.fingerprint(), cfg, advert=ShmAdvert(src.storage) if advert else None)


@pytest.mark.parametrize("plane", ["stream", "zmq"])
def test_same_node_pool_is_read_in_place(plane):
    src = _source()
    with _linked(src, data_plane=plane) as (served, tx):
        tx.connect()
        ack = tx.migrate(src, "a", "r1", 1, dedupe=False)
        assert tx.channel.pull  # the receiver mapped our pool file (offered at the first transfer)
        assert tx.export_config(src.storage).checksum_mode == "inline"  # its sums followed the offsets
        result = served.next()
        assert result.request_id == "r1" and ack.nbytes == result.nbytes > 0
        assert torch.equal(kv_bytes(served.manager, "r1"), kv_bytes(src, "a"))
        link = tx.channel.bulk
        assert link is None or link.sock is None  # nothing went on the bulk link


@pytest.mark.parametrize("threads", [1, 2])
def test_copies_land_the_same_bytes_and_report_their_checksums(threads, monkeypatch):
    from transfer import checksum as C
    from transfer.checksum import WINDOW
    from transfer.pull import ShmSource

    monkeypatch.setattr(C, "PARALLEL_MIN_BYTES", 0)  # small items, still shared by the threads

    layout = KVLayout(block_size=16, num_layers=8, num_kv_heads=8, head_dim=64, dtype="float16")
    src = make_manager(layout, 40, shm=True)  # 128 KiB blocks
    fill_random_sequence(src, "a", 600, torch.Generator().manual_seed(3), list(range(1, 601)))
    pool = bytes(src.storage.block_bytes_view(0, 38))
    # items of several buffers each, cut off the window grid, one smaller than a window
    cuts = [(5, [WINDOW + 3, 2 * WINDOW - 1]), (4 * WINDOW + 11, [7, WINDOW // 2]),
            (9 * WINDOW, [3 * WINDOW])]
    items = [(off, [memoryview(bytearray(n)) for n in sizes]) for off, sizes in cuts]
    digests = ShmSource(src.storage.shm_path.encode()).read_many(items, threads)
    for (off, bufs), digest in zip(items, digests):
        want = pool[off:off + sum(b.nbytes for b in bufs)]
        assert b"".join(bytes(b) for b in bufs) == want
        assert digest == checksum(want)


def test_a_pool_changed_after_its_manifest_fails_the_checksum_and_leaves_the_pool_as_it_was():
    src = _source()
    with _linked(src) as (served, tx):
        tx.connect()
        tx.channel.offer_pool()
        before = snapshot(served.manager)
        ex = export_sequence(src, "a", "r1", 1, config=ExportConfig(checksum_mode="manifest",
                                                                     checksum_threads=2))
        first = src.table("a").blocks[0]
        src.storage.block_bytes_view(first, 1)[3] ^= 1  # a byte of the first sent block, after hashing
        _pull_refused(tx, served, ex, ShmAdvert(src.storage).offsets(ex.frames), E.ChecksumError, before)
        ex.release()


def test_an_offer_the_receiver_cannot_open_is_declined_and_bytes_are_pushed(tmp_path):
    src = _source()
    served = Served(make_manager(LAYOUT, 64))

    class Elsewhere(ShmAdvert):  # a pool file that is not ours (or on another node)
        def offer(self):
            return PoolOffer("shm", str(tmp_path / "pdserve-kv-nothere").encode())

    cfg = TransportConfig(address=served.rx.address, checksum_mode="manifest", inline_bytes=0)
    tx = ZmqSender(src.storage.layout.fingerprint(), cfg, advert=Elsewhere(src.storage))
    try:
        tx.connect()
        tx.migrate(src, "a", "r1", 1, dedupe=False)
        assert not tx.channel.pull
        _landed_intact(served, src)
    finally:
        tx.close()
        served.stop()


@pytest.mark.parametrize("offer", [True, False])
def test_bad_offsets_fail_the_transfer_and_leave_the_pool_as_it_was(offer):
    src = _source()
    with _linked(src, advert="shm" if offer else None) as (served, tx):
        tx.connect()
        if offer:
            tx.channel.offer_pool()  # what its first transfer would do
            assert tx.channel.pull
        before = snapshot(served.manager)
        ex = export_sequence(src, "a", "r1", 1, config=ExportConfig(checksum_mode="manifest"))
        far = src.storage.data.numel() * src.storage.data.element_size()  # the pool's end
        _pull_refused(tx, served, ex, [far] * len(ex.manifest.frames), E.MalformedMessage, before)
        ex.release()


def test_a_payload_up_to_inline_bytes_is_pushed_behind_its_manifest(monkeypatch):
    # one round trip: a pull would add the offsets, the checksums and a read
    from transfer.channels import message_channel

    src = _source()
    assert src.table("a").num_computed * LAYOUT.token_bytes <= 256 << 10
    monkeypatch.setattr(message_channel, "_Pulled", lambda *a: pytest.fail("a small payload was pulled"))
    with _linked(src, inline_bytes=256 << 10) as (served, tx):
        tx.connect()
        tx.migrate(src, "a", "r1", 1)
        assert tx.channel.pull  # the receiver accepted the pool: the size alone decided
        _landed_intact(served, src)


@pytest.mark.parametrize("staged", [False, True])
def test_checksums_sent_after_the_offsets_are_verified_against_what_landed(staged):
    # an "inline" manifest: the receiver reads at "P" (staged: once the sums are here) and checks
    # every chunk against the "K" sums; good sums commit bit-exact, a bad one fails it
    src = _source(tokens=150)
    with _linked(src, stage=staged, chunk_bytes=8 << 10) as (served, tx):  # staged: as a device pool's
        tx.connect()
        assert tx.export_config(src.storage).checksum_mode == "inline"
        before = snapshot(served.manager)
        cfg = ExportConfig(checksum_mode="inline", chunk_bytes=8 << 10)
        ex = export_sequence(src, "a", "r1", 1, config=cfg)
        sums = [checksum(v) for _, _, v, _ in ex.chunks()]
        assert len(sums) > 2
        offsets = ShmAdvert(src.storage).offsets(ex.frames)
        bad = sums[:1] + [sums[1] ^ 1] + sums[2:]
        _pull_refused(tx, served, ex, offsets, E.ChecksumError, before, sums=bad)
        _pull_refused(tx, served, ex, offsets, E.FrameCountError, before, sums=sums[:-1], token=8)
        _pull_refused(tx, served, ex, offsets, E.MalformedMessage, before, sums=sums, token=9, order="KP")
        sock = tx.channel.sock
        sock.send_multipart([TOKEN.pack(b"M", 10), seal(encode(ex.manifest))])
        sock.send_multipart([TOKEN.pack(b"P", 10), encode_offsets(offsets)])
        sock.send_multipart([TOKEN.pack(b"K", 10), encode_offsets(sums)])
        _landed_intact(served, src)
        ex.release()


def test_checksums_after_a_declined_re_offer_fail_the_transfer(tmp_path):
    # the pool was offered again between the offsets and the checksums, and declined: nothing is
    # left to read the staged chunks from, so "K" fails the transfer (the pool as it was)
    import time

    from transfer.wire_codec import decode
    from transfer.wire_messages import PoolReply

    src = _source()
    with _linked(src, stage=True) as (served, tx):  # read at "K", not at "P"
        tx.connect()
        tx.channel.offer_pool()
        before = snapshot(served.manager)
        ex = export_sequence(src, "a", "r1", 1, config=ExportConfig(checksum_mode="inline"))
        sums = [checksum(v) for _, _, v, _ in ex.chunks()]

        def re_offer():
            elsewhere = encode(PoolOffer("shm", str(tmp_path / "pdserve-kv-nothere").encode()))
            reply = tx.channel.request("pool", elsewhere, time.monotonic() + 5)
            assert not decode(reply, tx.config.limits, PoolReply).accepted

        offsets = ShmAdvert(src.storage).offsets(ex.frames)
        _pull_refused(tx, served, ex, offsets, E.MalformedMessage, before, sums=sums, before_sums=re_offer)
        ex.release()


@contextlib.contextmanager
def _linked(src, advert="shm", stage=False, **config):
    """A receiver of a 64-block pool served on a thread (`stage`: its chunks land in staging first,
    one at a time, as for a device pool) and a sender from `src` to it (`_sender`); both closed after."""
    served = Served(make_manager(LAYOUT, 64), **{k: config[k] for k in ("data_plane",) if k in config})
    served.rx.stage = stage
    tx = _sender(src, served.rx.address, advert, **config)
    try:
        yield served, tx
    finally:
        tx.close()
        served.stop()


def _landed_intact(served, src):
    """The receiver committed "r1", holding exactly the K/V of `src`'s sequence "a"."""
    assert served.next().request_id == "r1"
    assert torch.equal(kv_bytes(served.manager, "r1"), kv_bytes(src, "a"))


def _pull_refused(tx, served, ex, offsets, error, before, sums=None, token=7, order="PK", before_sums=None):
    """Send `ex`'s manifest, then `offsets` in the sender's pool (and `sums`, "K", in `order`; called
    just before them: `before_sums`), on tx's control socket: the receiver fails the transfer with
    `error`, nacks it and leaves its pool as `before`."""
    sock = tx.channel.sock
    sock.send_multipart([TOKEN.pack(b"M", token), seal(encode(ex.manifest))])
    msgs = {"P": [TOKEN.pack(b"P", token), encode_offsets(offsets)],
            "K": [TOKEN.pack(b"K", token), encode_offsets(sums or [])]}
    for kind in order if sums is not None else "P":
        if kind == "K" and before_sums is not None:
            before_sums()
        sock.send_multipart(msgs[kind])
    assert isinstance(served.next(), error)
    assert sock.poll(5000) and sock.recv_multipart()[0] == TOKEN.pack(b"A", token)  # nacked
    assert snapshot(served.manager) == before


def test_a_source_that_does_not_hash_is_read_in_groups_each_hashed_while_the_next_lands():
    # transfer.pull._land_chunks with a source that only moves bytes (as a NIXL agent's READ does):
    # above PARALLEL_MIN_BYTES it reads READ_GROUPS groups, and every digest is of what landed
    import numpy as np

    from transfer import pull
    from transfer.checksum import checksum_parts

    rng = np.random.default_rng(0)
    remote = rng.integers(0, 256, size=8 << 20, dtype=np.uint8)  # the sender's pool
    local = np.zeros_like(remote)

    class CopySource:
        hashes = False

        def __init__(self):
            self.calls = []

        def read_many(self, items, threads=1):
            self.calls.append(len(items))
            for offset, bufs in items:
                for b in bufs:
                    n = memoryview(b).nbytes
                    np.frombuffer(b, dtype=np.uint8)[:] = remote[offset:offset + n]
                    offset += n
            return [None] * len(items)

    chunk = 1 << 20
    items = [(i * chunk, [memoryview(local[i * chunk:i * chunk + chunk // 2]),
                          memoryview(local[i * chunk + chunk // 2:(i + 1) * chunk])]) for i in range(8)]
    src = CopySource()
    digests = pull._land_chunks(src, items, threads=2)
    assert src.calls == [2] * pull.READ_GROUPS and np.array_equal(local, remote)
    assert digests == [checksum_parts(bufs) for _, bufs in items]
    assert digests[3] == checksum_parts([memoryview(remote[3 * chunk:4 * chunk])])
    src = CopySource()  # one thread: one read, hashed after
    assert pull._land_chunks(src, items, threads=1) == digests and src.calls == [8]
