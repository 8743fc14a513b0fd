"""The bulk link beside the ZeroMQ control channel (transfer.channels.bulk_wire): a receiver that
meets a wrong token, a stream cut halfway, more bytes than its offer, a stream for a transfer
that was refused, or chunks out of order refuses it, counts it and keeps its pool exactly as it
was; a proper sender still gets through afterwards, over tcp and over a Unix socket. Driven by
`BulkPeer`: a hand-driven DEALER plus a raw link socket."""

import socket
import time

import msgpack
import pytest
import torch
import zmq
from zmq_helpers import Served, kv_bytes, pool, snapshot

from measure.pools import fill_random_sequence
from transfer import errors as E
from transfer.channels.bulk_wire import CHUNK, END, OPEN, OPEN_MAGIC, XFER, XFER_MAGIC
from transfer.channels.zmq_channel import ZmqSender
from transfer.checksum import checksum
from transfer.export import ExportConfig, export_sequence
from transfer.transport import TransportConfig, ipc_address
from transfer.wire import TOKEN
from transfer.wire_codec import encode, seal
from transfer.wire_messages import Hello


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(5)


class BulkPeer:
    """Says hello asking for a tcp stream, then sends whatever the test wants."""

    def __init__(self, served, fingerprint):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(served.rx.address)
        self.sock.send_multipart([b"H", encode(Hello(fingerprint, "raw", stream="tcp"))])
        assert self.sock.poll(5000)
        header, body = self.sock.recv_multipart()
        reply = msgpack.unpackb(body, raw=False)
        assert header == b"h" and reply["data_port"] > 0, reply
        self.port, self.token = reply["data_port"], bytes.fromhex(reply["data_token"])
        self.stream = None

    def open(self, token=None):
        self.stream = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        self.stream.sendall(OPEN.pack(OPEN_MAGIC, token or self.token))
        return self.stream.recv(1)

    def offer(self, ex, tok):
        self.sock.send_multipart([TOKEN.pack(b"S", tok), seal(encode(ex.manifest))])

    def chunks(self, ex):
        return [(CHUNK.pack(f, c, checksum(view)), bytes(view)) for f, c, view, _ in ex.chunks()]

    def verdict(self):
        assert self.sock.poll(10000), "no verdict"
        return msgpack.unpackb(self.sock.recv_multipart()[1], raw=False)

    def close(self):
        if self.stream is not None:
            self.stream.close()
        self.sock.close(0)
        self.ctx.term()


def _export(src, gen):
    fill_random_sequence(src, "a", 200, gen)
    return export_sequence(src, "a", "r", 1, config=ExportConfig(chunk_bytes=4096, checksum_mode="inline"))


def _stream_of(peer, ex, tok, nbytes=None, chunks=None, end=True):
    parts = [XFER.pack(XFER_MAGIC, tok, ex.manifest.payload_bytes if nbytes is None else nbytes)]
    for head, data in peer.chunks(ex) if chunks is None else chunks:
        parts += [head, data]
    if end:
        parts.append(CHUNK.pack(END, 0, 0))
    return b"".join(parts)


def _closed(sock) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:  # closed with our bytes unread
        return True


CASES = ["wrong token", "cut halfway", "bytes beyond the offer", "stream for a refused transfer",
         "chunks reordered", "chunk repeated", "flipped bit"]


@pytest.mark.parametrize("case", CASES)
def test_bad_streams_leave_the_pool_unchanged(gen, case):
    src, dst = pool(), pool()
    fill_random_sequence(dst, "resident", 30, gen)
    before = snapshot(dst)
    served = Served(dst, idle_timeout_s=1.0)
    peer = BulkPeer(served, src.storage.layout.fingerprint())
    ex = _export(src, gen)
    try:
        chunks = peer.chunks(ex)
        if case == "wrong token":
            assert peer.open(token=b"\x01" * 16) == b""  # closed: not even a refusal to parse
            time.sleep(0.2)
            assert served.metrics.counters["stream_token_refused"] == 1
        else:
            assert peer.open() == b"K"
        if case == "cut halfway":
            peer.offer(ex, 1)
            peer.stream.sendall(_stream_of(peer, ex, 1, chunks=chunks[:3], end=False))
            peer.stream.close()
            peer.stream = None
            assert isinstance(served.next(), E.TransportClosed)
            assert peer.verdict()["code"] == "closed"
        elif case == "bytes beyond the offer":
            peer.offer(ex, 1)
            peer.stream.sendall(_stream_of(peer, ex, 1, nbytes=ex.manifest.payload_bytes + 4096))
            assert isinstance(served.next(), E.FrameSizeError)
            assert peer.verdict()["code"] == "frame_size"
        elif case == "stream for a refused transfer":
            bad = bytearray(seal(encode(ex.manifest)))
            bad[10] ^= 1
            peer.sock.send_multipart([TOKEN.pack(b"S", 1), bytes(bad)])
            peer.stream.sendall(_stream_of(peer, ex, 1))
            assert isinstance(served.next(), E.ChecksumError)  # the manifest's seal
            assert _closed(peer.stream)  # its payload was not awaited: the stream closed
            assert served.metrics.counters["stray_streams"] == 1
        elif case in ("chunks reordered", "chunk repeated", "flipped bit"):
            if case == "chunks reordered":
                chunks[1], chunks[2] = chunks[2], chunks[1]
            elif case == "chunk repeated":
                chunks.insert(3, chunks[3])
            else:
                head, data = chunks[4]
                chunks[4] = (head, data[:100] + bytes([data[100] ^ 4]) + data[101:])
            peer.offer(ex, 1)
            peer.stream.sendall(_stream_of(peer, ex, 1, chunks=chunks))
            err = E.ChecksumError if case == "flipped bit" else E.FrameCountError
            assert isinstance(served.next(), err)
            assert peer.verdict()["code"] == err.code
        assert snapshot(dst) == before
        # the receiver is still healthy: a proper sender gets through afterwards
        tx = ZmqSender(src.storage.layout.fingerprint(), TransportConfig(address=served.rx.address))
        assert tx.migrate(src, "a", "ok", 1).new_blocks == 13
        assert served.next().request_id == "ok"
        tx.close()
    finally:
        peer.close()
        served.stop()
    assert torch.equal(kv_bytes(dst, "ok"), kv_bytes(src, "a"))
    dst.free("ok")
    dst.allocator.evict_cached()
    assert snapshot(dst) == before
    dst.check_integrity()


@pytest.mark.parametrize("plane,inline", [("stream", 0), ("zmq", 0), ("stream", 1 << 20)],
                         ids=["stream", "zmq", "stream-small-inline"])
def test_ipc_and_tcp_carry_the_same_bytes_on_either_data_plane(gen, plane, inline):
    """inline 0: the payload takes the named data plane; 1 MiB: this 43 KiB payload follows its
    manifest on the control socket even though a bulk link is open."""
    src, dst = pool(), pool()
    fill_random_sequence(src, "a", 333, gen)
    for address in ("tcp://127.0.0.1:0", ipc_address()):
        served = Served(dst, address=address, auto_free=True, data_plane=plane)
        tx = ZmqSender(src.storage.layout.fingerprint(), TransportConfig(
            address=served.rx.address, chunk_bytes=8192, data_plane=plane, inline_bytes=inline))
        try:
            tx.connect()
            assert (tx.channel.bulk is not None) == (plane == "stream")
            for i in range(3):
                tx.migrate(src, "a", f"r{i}", 1, dedupe=False)
                assert torch.equal(served.kv[served.next().seq_id], kv_bytes(src, "a"))
            if plane == "stream":  # the bulk link opens only for a payload that takes it
                assert (tx.channel.bulk.sock is None) == bool(inline)
        finally:
            tx.close()
            served.stop()
