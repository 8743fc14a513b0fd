"""An end marker on the control socket for a transfer whose payload is still landing on the bulk
link (what `pdserve bench fuzz`'s stream/end_mid_stream sends): the receiver must not commit
beside the stream's reader thread. The ordering is forced: every chunk has landed (the reader
waits for the stream's END) when the end marker is served. The commit waits for the landing, and
the connection's next transfer, payload on the control socket, still gets through (it used to be
refused with "transfer ended early: chunk (0, 0) missing": its chunks were dropped as stray
because the committed transfer's landing stayed on the peer)."""

import socket
import time

import msgpack
import torch
import zmq
from zmq_helpers import kv_bytes, pool, snapshot

from measure.pools import fill_random_sequence
from transfer.channels.bulk_wire import CHUNK, END, OPEN, OPEN_MAGIC, XFER, XFER_MAGIC
from transfer.channels.zmq_receiver import ZmqReceiver
from transfer.checksum import checksum
from transfer.export import ExportConfig, export_sequence
from transfer.metrics import TransferMetrics
from transfer.transport import TransportConfig
from transfer.wire import DATA, TOKEN
from transfer.wire_codec import encode, seal
from transfer.wire_messages import Hello


def _poll_until(rx, pred, what, timeout=10.0):
    """Serve on this thread until `pred(result)` holds; the receiver's error is raised."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = rx.poll(0.02)
        if pred(result):
            return result
    raise AssertionError(f"timed out waiting for {what}")


def test_an_end_marker_while_the_stream_lands_commits_only_after_the_landing():
    gen = torch.Generator().manual_seed(3)
    src, dst = pool(), pool()
    fill_random_sequence(src, "a", 200, gen)
    before = snapshot(dst)
    cfg = ExportConfig(chunk_bytes=4096, checksum_mode="inline")
    metrics = TransferMetrics()
    rx = ZmqReceiver(dst, TransportConfig(address="tcp://127.0.0.1:0", idle_timeout_s=5.0), metrics=metrics)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(rx.address)
    stream = None
    try:
        sock.send_multipart([b"H", encode(Hello(src.storage.layout.fingerprint(), "raw", stream="tcp"))])
        _poll_until(rx, lambda r: sock.poll(0), "the handshake")
        header, body = sock.recv_multipart()
        hello = msgpack.unpackb(body, raw=False)
        assert header == b"h" and hello["data_port"] > 0, hello
        stream = socket.create_connection(("127.0.0.1", hello["data_port"]), timeout=5)
        stream.sendall(OPEN.pack(OPEN_MAGIC, bytes.fromhex(hello["data_token"])))
        assert stream.recv(1) == b"K"

        # transfer 1: manifest on the control socket, every chunk on the stream, END held back
        ex = export_sequence(src, "a", "r1", 1, config=cfg)
        try:
            sock.send_multipart([TOKEN.pack(b"S", 1), seal(encode(ex.manifest))])
            _poll_until(rx, lambda r: rx.active, "the offer")
            session = next(iter(rx.active.values())).session
            parts = [XFER.pack(XFER_MAGIC, 1, ex.manifest.payload_bytes)]
            for f, c, view, _ in ex.chunks():
                parts += [CHUNK.pack(f, c, checksum(view)), bytes(view)]
        finally:
            ex.release()
        stream.sendall(b"".join(parts))
        deadline = time.monotonic() + 10
        while session.next_chunk() is not None:  # the reader landed them all; it now waits for END
            assert time.monotonic() < deadline, "the chunks did not land"
            time.sleep(0.005)

        # the end marker while the reader is still in the transfer: no commit beside it
        sock.send_multipart([TOKEN.pack(b"E", 1), b""])
        for _ in range(10):
            assert rx.poll(0.02) is None, "committed while the stream was still landing"
        assert not sock.poll(0) and rx.in_flight() == {"r1": session.dst_blocks}
        assert metrics.counters["ends_before_landing"] == 1

        stream.sendall(CHUNK.pack(END, 0, 0))  # the stream's own end: the landing finishes, commits
        first = _poll_until(rx, lambda r: r is not None, "the streamed commit")
        assert first.request_id == "r1" and not rx.in_flight()
        header, body = sock.recv_multipart()
        assert header == TOKEN.pack(b"A", 1) and msgpack.unpackb(body, raw=False)["kind"] == "ack"

        # transfer 2 on the same connection, payload on the control socket: not dropped as stray
        ex = export_sequence(src, "a", "r2", 1, config=cfg)
        try:
            sock.send_multipart([TOKEN.pack(b"M", 2), seal(encode(ex.manifest))])
            for f, c, view, _ in ex.chunks():
                sock.send_multipart([DATA.pack(b"D", 2, f, c, checksum(view)), bytes(view)])
        finally:
            ex.release()
        sock.send_multipart([TOKEN.pack(b"E", 2), b""])
        second = _poll_until(rx, lambda r: r is not None, "the control-socket commit")
        assert second.request_id == "r2"
        header, body = sock.recv_multipart()
        assert header == TOKEN.pack(b"A", 2) and msgpack.unpackb(body, raw=False)["kind"] == "ack"
        assert metrics.counters["stray_chunks"] == 0 and not metrics.errors
        for seq in ("r1", "r2"):
            assert torch.equal(kv_bytes(dst, seq), kv_bytes(src, "a"))
            dst.free(seq)
    finally:
        if stream is not None:
            stream.close()
        sock.close(0)
        ctx.term()
        rx.close()
    dst.allocator.evict_cached()
    assert snapshot(dst) == before
    dst.check_integrity()
