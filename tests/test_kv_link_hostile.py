"""Issue 28's KV-link cases against real in-process receivers (ZeroMQ, its bulk link, Ray's
endpoint): nothing an unauthenticated peer sends escapes as an exception or costs more than a few
KiB, a bounded time, or a slot of admitted streams (case 2: a non-ASCII HMAC tag; case 4: an
oversized hello; case 3: slow data-stream openings; case 9: idle connections without a
handshake), refusals are counted and logged at a bounded rate (case 10), and a signed handshake
is bound to its receiver, whose reply is signed (case 8). Waits are bounded; nothing here asserts
a speed."""

import logging
import socket
import time

import msgpack
import pytest
import torch
import zmq
from zmq_helpers import Served, pool

from measure.pools import fill_random_sequence
from protocol.curve import ClusterKeys, hmac_verify, new_nonce
from transfer import errors as E
from transfer.channels import bulk_open
from transfer.channels.ray_receiver import RayReceiverEndpoint
from transfer.channels.zmq_channel import ZmqSender
from transfer.channels.zmq_handshake import client_keys
from transfer.metrics import TransferMetrics
from transfer.transport import TransportConfig, make_hello
from transfer.wire_codec import encode
from transfer.wire_messages import PROTOCOL_VERSION

SECRET = ClusterKeys.generate().secret


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(28)


def _source(gen, name="a", tokens=40):
    src = pool()
    fill_random_sequence(src, name, tokens, gen)
    return src


def _hello_wire(src, tag="\u00e9" * 64, **extra) -> dict:
    """A fresh hello with a random nonce and whatever tag (no "to": an old sender's shape)."""
    return {"v": PROTOCOL_VERSION, "kind": "hello", "fingerprint": src.storage.layout.fingerprint(),
            "peer": "intruder", "issued_at": time.time(), "nonce": new_nonce(), "tag": tag, "stream": "",
            "pool_path": "", **extra}


class Raw:
    """A bare DEALER on the receiver's control socket; with `secret`, holding the cluster's CURVE
    key (a keyed receiver admits nobody else), so what it sends reaches the receiver's own checks."""

    def __init__(self, address: str, secret: str = ""):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        client_keys(self.sock, secret)
        self.sock.setsockopt(zmq.RECONNECT_IVL, -1)  # once closed by the receiver, it stays closed
        self.events = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(address)

    def send(self, *parts: bytes) -> None:
        self.sock.send_multipart(list(parts))

    def reply(self, timeout: float = 10.0) -> tuple[bytes, dict]:
        assert self.sock.poll(int(timeout * 1000)), "no reply"
        header, body = self.sock.recv_multipart()
        return header, msgpack.unpackb(body, raw=False)

    def disconnected(self, timeout: float) -> bool:
        return bool(self.events.poll(int(timeout * 1000)))

    def close(self) -> None:
        self.sock.disable_monitor()
        self.events.close(0)
        self.sock.close(0)
        self.ctx.term()


def _migrates(src, served, name="a", rid="ok", **config) -> None:
    tx = ZmqSender(src.storage.layout.fingerprint(), TransportConfig(address=served.rx.address, **config))
    try:
        assert tx.migrate(src, name, rid, 1).request_id == rid
        assert served.next().request_id == rid
        served.manager.free(rid)
    finally:
        tx.close()


def test_case2_non_ascii_tag_is_a_refusal_not_a_dead_loop(gen):
    assert not hmac_verify(SECRET, ["f"], time.time(), new_nonce(), "\u00e9" * 64, {})  # no TypeError
    assert not hmac_verify(SECRET, ["f"], time.time(), "\u00e9" * 32, "ab" * 32, {})
    src, served = _source(gen), Served(pool(), secret=SECRET)
    raw = Raw(served.rx.address, SECRET)
    try:
        for tag in ("\u00e9" * 64, "x" * 64, "ab", "\u00e9"):
            raw.send(b"H", msgpack.packb(_hello_wire(src, tag), use_bin_type=True))
            assert raw.reply()[1]["code"] == "refused"
        assert served.thread.is_alive()  # the receiver's loop is still serving
        assert served.events.empty()  # refusals never leave poll
        assert served.metrics.refusals["refused"] == 4
        _migrates(src, served, secret=SECRET)
    finally:
        raw.close()
        served.stop()
    rx = RayReceiverEndpoint(pool(), TransportConfig(secret=SECRET))  # the Ray transport: the same
    reply = _ray(rx, b"H", msgpack.packb(_hello_wire(src), use_bin_type=True))
    assert reply["code"] == "refused" and not rx.peers.known


def test_case4_oversized_hello_and_early_query_are_refused_unread(gen, monkeypatch):
    import transfer.receiver_hello as handshake

    decoded = []
    real = handshake.decode
    monkeypatch.setattr(handshake, "decode", lambda *a, **k: decoded.append(1) or real(*a, **k))
    src, served = _source(gen), Served(pool(), secret=SECRET)
    raw = Raw(served.rx.address, SECRET)
    big = msgpack.packb(list(range(1 << 20)), use_bin_type=True)  # ~3 MiB of msgpack array
    try:
        raw.send(b"H", big)
        assert raw.reply()[1]["code"] == "limits"
        raw.send(b"Q", big)  # a query before any handshake: not read either
        assert raw.reply()[1]["code"] == "handshake"
        assert decoded == [] and served.thread.is_alive() and served.events.empty()
        assert served.metrics.refusals["limits"] == 1 and served.metrics.refusals["handshake"] == 1
        _migrates(src, served, secret=SECRET)
    finally:
        raw.close()
        served.stop()
    rx = RayReceiverEndpoint(pool(), TransportConfig(secret=SECRET))
    assert _ray(rx, b"H", big)["code"] == "limits"
    assert _ray(rx, b"Q", big)["code"] == "handshake"


def test_case3_a_trickled_stream_opening_is_cut_at_its_total_deadline(gen):
    src, served = _source(gen), Served(pool())  # the default total deadline: stream_open_s=1.0
    slow = [socket.create_connection(("127.0.0.1", served.rx.bulk.port), timeout=5) for _ in range(5)]
    try:
        closed = set()
        deadline = time.monotonic() + 5.0  # short of the 7.2 s the 24-byte opening takes at this pace
        while len(closed) < len(slow) and time.monotonic() < deadline:
            for i, s in enumerate(slow):
                if i not in closed:
                    try:
                        s.sendall(b"P")  # one byte every 0.3 s: each recv alone is quick
                    except OSError:
                        closed.add(i)
            time.sleep(0.3)
        assert len(closed) == len(slow)
        assert served.metrics.refusals["stream_open"] == len(slow)
        _migrates(src, served)
    finally:
        for s in slow:
            s.close()
        served.stop()


def test_case3_unauthenticated_openings_have_their_own_cap_and_cannot_keep_a_sender_out(gen, monkeypatch):
    monkeypatch.setattr(bulk_open, "MAX_OPENING", 4)
    src, served = _source(gen, tokens=200), Served(pool(num_blocks=128), stream_open_s=30.0)
    config = TransportConfig(address=served.rx.address, inline_bytes=0)
    tx = ZmqSender(src.storage.layout.fingerprint(), config)
    idle = []
    try:
        tx.migrate(src, "a", "first", 1)  # its bulk link is open: an admitted stream's slot
        served.next()
        idle = [socket.create_connection(("127.0.0.1", served.rx.bulk.port), timeout=5) for _ in range(6)]
        for s in idle:
            s.sendall(b"P")  # half an opening, held for its 30 s deadline
        assert sum(s.recv(1) == bulk_open.BUSY for s in idle[:2]) == 2  # past the cap: the oldest cut
        assert served.metrics.refusals["stream_busy"] == 2
        assert tx.migrate(src, "a", "second", 2).request_id == "second"  # the open stream still works
        served.next()
        sent = TransferMetrics()
        tx2 = ZmqSender(src.storage.layout.fingerprint(), config, metrics=sent)
        try:  # every opening slot is held, yet a sender with its token opens a stream (issue 49)
            assert tx2.migrate(src, "a", "third", 3, dedupe=False).request_id == "third"
            assert served.next().request_id == "third"
            assert tx2.channel.bulk.sock is not None and sent.counters["data_stream_fallbacks"] == 0
        finally:
            tx2.close()
    finally:
        for s in idle:
            s.close()
        tx.close()
        served.stop()


def test_case9_idle_connections_without_a_handshake_are_closed_and_forgotten(gen):
    src, served = _source(gen), Served(pool(), secret=SECRET, preauth_s=0.5)
    silent, chatty = Raw(served.rx.address, SECRET), Raw(served.rx.address, SECRET)
    tx = ZmqSender(src.storage.layout.fingerprint(), TransportConfig(address=served.rx.address,
                                                                      secret=SECRET))
    try:
        tx.connect()
        chatty.send(b"Q", b"\x00" * 10)
        assert chatty.reply()[1]["code"] == "handshake"
        assert len(served.rx.peers.strangers) == 1
        assert silent.disconnected(10.0) and chatty.disconnected(10.0)  # closed by the receiver
        deadline = time.monotonic() + 5.0
        while (served.rx.peers.strangers or served.metrics.refusals["idle_preauth"] < 2) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not served.rx.peers.strangers and served.metrics.refusals["idle_preauth"] == 2
        assert tx.migrate(src, "a", "ok", 1).request_id == "ok"  # the handshaken one stayed
        assert served.next().request_id == "ok"
    finally:
        silent.close()
        chatty.close()
        tx.close()
        served.stop()


def test_case10_refusals_are_counted_and_logged_at_a_bounded_rate(gen, caplog):
    served = Served(pool(), secret=SECRET)
    raw = Raw(served.rx.address, SECRET)
    caplog.set_level(logging.WARNING, logger="transfer.refusals")
    try:
        for _ in range(50):
            raw.send(b"H", b"\xc1garbage")
            raw.send(b"M" + b"\x00" * 8, b"\x00" * 100)
        for _ in range(100):
            raw.reply()
        assert served.metrics.refusals["malformed"] == 50 and served.metrics.refusals["handshake"] == 50
        assert served.metrics.snapshot()["refusals"]["malformed"] == 50
        lines = [r for r in caplog.records if r.name == "transfer.refusals"]
        assert 1 <= len(lines) <= 4  # one per reason per interval, not one per refusal
        assert served.events.empty()
    finally:
        raw.close()
        served.stop()


def test_case8_a_hello_is_bound_to_its_receiver_and_the_reply_is_signed(gen):
    src = _source(gen)
    d0 = Served(pool(), secret=SECRET, peer_name="decode-0")
    d1 = Served(pool(), secret=SECRET, peer_name="decode-1")
    to0 = TransportConfig(address=d0.rx.address, secret=SECRET, peer_name="prefill-0", receiver="decode-0")
    captured = encode(make_hello(src.storage.layout.fingerprint(), to0))
    r0, r1, r1b = Raw(d0.rx.address, SECRET), Raw(d1.rx.address, SECRET), Raw(d1.rx.address, SECRET)
    try:
        r0.send(b"H", captured)
        assert r0.reply()[1]["kind"] == "hello_ok"  # meant for decode-0: accepted there
        r1.send(b"H", captured)
        assert r1.reply()[1]["code"] == "refused"  # the same bytes replayed to decode-1
        r1b.send(b"H", encode(make_hello(src.storage.layout.fingerprint(), to0)))
        assert r1b.reply()[1]["code"] == "refused"  # a fresh hello for decode-0, sent to decode-1
        r0.send(b"H", captured)
        assert r0.reply()[1]["code"] == "refused"  # and replayed to decode-0 itself: the nonce is spent
        _migrates(src, d1, secret=SECRET, peer_name="prefill-0", receiver="decode-1")
    finally:
        for r in (r0, r1, r1b):
            r.close()
        d0.stop()
        d1.stop()
    keyless = Served(pool(), peer_name="decode-0")  # no secret: its reply is not signed
    tx = ZmqSender(src.storage.layout.fingerprint(),
                   TransportConfig(address=keyless.rx.address, secret=SECRET, receiver="decode-0"))
    try:
        with pytest.raises(E.Unauthenticated):
            tx.connect()
    finally:
        tx.close()
        keyless.stop()
    rx = RayReceiverEndpoint(pool(), TransportConfig(secret=SECRET, peer_name="decode-1"))
    reply = _ray(rx, b"H", encode(make_hello(src.storage.layout.fingerprint(), to0)))
    assert reply["code"] == "refused"


def _ray(rx, header: bytes, body: bytes) -> dict:
    """One message to a Ray receiver endpoint as its actor's call would bring it; the first answer."""
    replies = msgpack.unpackb(rx.kv("c", msgpack.packb([header], use_bin_type=True), body), raw=False)
    return msgpack.unpackb(replies[0][1], raw=False)
