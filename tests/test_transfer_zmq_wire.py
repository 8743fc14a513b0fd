"""A ZeroMQ receiver that survives bad traffic with its pool unchanged: a truncated, extra or
wrongly checksummed chunk, an extra message part, an unknown protocol version, garbage, a sender
that vanishes mid-transfer and data before the handshake, each answered by a typed nack (or a
timeout) and counted, after which a proper sender still gets through. Sent by `RawPeer`, a
hand-driven DEALER socket."""

import time

import msgpack
import pytest
import torch
import zmq
from zmq_helpers import Served, pool, snapshot

from measure.pools import fill_random_sequence
from transfer import errors as E
from transfer.channels.zmq_channel import ZmqSender
from transfer.checksum import checksum
from transfer.export import ExportConfig, export_sequence
from transfer.transport import TransportConfig
from transfer.wire import DATA, TOKEN
from transfer.wire_codec import encode, seal
from transfer.wire_messages import PROTOCOL_VERSION, Hello


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(11)


class RawPeer:
    """A hand-driven DEALER for sending malformed traffic."""

    def __init__(self, address):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def hello(self, fingerprint):
        self.sock.send_multipart([b"H", encode(Hello(fingerprint))])
        assert self.sock.poll(5000)
        assert self.sock.recv_multipart()[0] == b"h"

    def reply(self):
        assert self.sock.poll(5000), "no reply"
        header, body = self.sock.recv_multipart()
        return header, msgpack.unpackb(body, raw=False)

    def close(self):
        self.sock.close(0)
        self.ctx.term()


def _stream(ex, token, tamper=None):
    """The messages of a transfer; `tamper(i, header, chunk)` returns the messages for chunk i."""
    msgs = [[TOKEN.pack(b"M", token), seal(encode(ex.manifest))]]
    for i, (f, c, view, _) in enumerate(ex.chunks()):
        msg = [DATA.pack(b"D", token, f, c, checksum(view)), bytes(view)]
        msgs += tamper(i, *msg) if tamper else [msg]
    return msgs + [[TOKEN.pack(b"E", token), b""]]


def _manifest_version(ex, v):
    d = msgpack.unpackb(encode(ex.manifest), raw=False)
    d["v"] = v
    return seal(msgpack.packb(d, use_bin_type=True))


WIRE_BAD = {  # 200 tokens of 128 bytes in 4096-byte chunks: chunks 0..6
    "truncated chunk": (lambda i, h, c: [[h, c[:-3]] if i == 1 else [h, c]], E.FrameSizeError),
    "extra chunk": (lambda i, h, c: [[h, c]] + ([[DATA.pack(b"D", 1, 0, 7, 0), c]] if i == 6 else []),
                    E.FrameCountError),
    "wrong checksum": (lambda i, h, c: [[h[:-8] + b"\0" * 8, c] if i == 2 else [h, c]], E.ChecksumError),
    "extra message part": (lambda i, h, c: [[h, c, b"junk"] if i == 0 else [h, c]], E.MalformedMessage),
}


@pytest.mark.parametrize("case", sorted(WIRE_BAD) + ["unknown version", "garbage", "vanishing sender",
                                                     "no handshake", "flipped manifest bit"])
def test_receiver_survives_bad_traffic_with_pool_unchanged(gen, case):
    src, dst = pool(), pool()
    fill_random_sequence(dst, "resident", 30, gen)
    before = snapshot(dst)
    served = Served(dst, idle_timeout_s=1.0)
    raw = RawPeer(served.rx.address)
    fill_random_sequence(src, "a", 200, gen)
    ex = export_sequence(src, "a", "r", 1, config=ExportConfig(chunk_bytes=4096, checksum_mode="inline"))
    assert ex.manifest.num_chunks == 7
    try:
        if case != "no handshake":
            raw.hello(src.storage.layout.fingerprint())
        if case in WIRE_BAD:
            tamper, err = WIRE_BAD[case]
            for msg in _stream(ex, 1, tamper):
                raw.sock.send_multipart(msg)
            header, nack = raw.reply()
            assert header == TOKEN.pack(b"A", 1) and nack["code"] == err.code
        elif case == "unknown version":
            err = E.ProtocolVersionError
            raw.sock.send_multipart([TOKEN.pack(b"M", 1), _manifest_version(ex, PROTOCOL_VERSION + 1)])
            assert raw.reply()[1]["code"] == "version"
        elif case == "no handshake":
            err = E.HandshakeRequired
            raw.sock.send_multipart(_stream(ex, 1)[0])
            assert raw.reply()[1]["code"] == "handshake"
        elif case == "flipped manifest bit":  # e.g. a token id or a sampling seed: refused whole
            err = E.ChecksumError
            body = bytearray(seal(encode(ex.manifest)))
            body[len(body) // 2] ^= 0x10
            raw.sock.send_multipart([TOKEN.pack(b"M", 1), bytes(body)])
            assert raw.reply()[1]["code"] == "checksum"
        elif case == "garbage":
            err = E.MalformedMessage
            raw.sock.send_multipart([b"\xff\x00garbage", b"\x00" * 100])
            assert raw.reply()[1]["code"] == "malformed"
        else:  # the sender sends the manifest and two chunks, then is gone
            err = E.TransferTimeout
            for msg in _stream(ex, 1)[:3]:
                raw.sock.send_multipart(msg)
            raw.close()
        if case == "no handshake":  # before authentication: a counted refusal, never raised by poll
            assert served.metrics.refusals["handshake"] == 1
        else:
            got = served.next()
            assert isinstance(got, err), got
        assert served.metrics.errors[err.code] == 1
        # the receiver is still healthy: a proper sender gets through afterwards
        tx = ZmqSender(src.storage.layout.fingerprint(), TransportConfig(address=served.rx.address))
        assert tx.migrate(src, "a", "ok", 1).new_blocks == 13
        assert served.next().request_id == "ok"
        tx.close()
    finally:
        if case != "vanishing sender":
            raw.close()
        served.stop()
    dst.free("ok")
    dst.allocator.evict_cached()  # the good import's blocks stayed cached for prefix reuse
    assert snapshot(dst) == before
    dst.check_integrity()


def test_a_trickling_sender_is_cut_off_by_the_total_transfer_limit(gen):
    """One chunk just inside the idle timeout each time still ends at max_transfer_s: a sender
    cannot keep a reservation alive forever. The pool is as it was."""
    src, dst = pool(), pool()
    before = snapshot(dst)
    served = Served(dst, idle_timeout_s=5.0, max_transfer_s=1.0)
    raw = RawPeer(served.rx.address)
    fill_random_sequence(src, "a", 200, gen)
    ex = export_sequence(src, "a", "r", 1, config=ExportConfig(chunk_bytes=4096, checksum_mode="inline"))
    try:
        raw.hello(src.storage.layout.fingerprint())
        messages = _stream(ex, 1)
        for msg in messages[:4]:  # the manifest, then a chunk every 0.4 s (well inside the idle 5 s)
            raw.sock.send_multipart(msg)
            time.sleep(0.4)
        got = served.next()
        assert isinstance(got, E.TransferTimeout) and "running" in str(got)
    finally:
        raw.close()
        served.stop()
    assert snapshot(dst) == before


def test_a_manifest_repeated_after_its_transfer_committed_is_ignored(gen):
    """A duplicated manifest that arrives after its transfer already committed (the chaos
    benchmark's dup_control on a fast stream) is a duplicate, not a new transfer to refuse."""
    src, dst = pool(), pool()
    served = Served(dst, auto_free=True)
    raw = RawPeer(served.rx.address)
    fill_random_sequence(src, "a", 40, gen)
    ex = export_sequence(src, "a", "r", 1, config=ExportConfig(chunk_bytes=4096, checksum_mode="inline"))
    try:
        raw.hello(src.storage.layout.fingerprint())
        msgs = _stream(ex, 7)
        for msg in msgs:
            raw.sock.send_multipart(msg)
        assert raw.reply()[0] == TOKEN.pack(b"A", 7)  # acked
        assert served.next().request_id == "r"
        raw.sock.send_multipart(msgs[0])  # the same manifest again
        time.sleep(0.3)
        assert served.events.empty() and not raw.sock.poll(100)  # no new transfer, no nack
        assert served.metrics.counters["duplicate_manifests"] == 1 and not served.metrics.errors
    finally:
        raw.close()
        served.stop()
