"""Issue 49, item 3: a KV receiver keyed with the cluster secret is a CURVE server. A peer without
the key never completes ZeroMQ's handshake, so the unfinished multipart message it announces (libzmq
buffers a multipart message whole before the application sees it) is never taken in; a sender
with a wrong key or none is told why at once; a member still migrates. Attacks go to loopback,
bounded in bytes; waits are bounded; nothing here asserts a speed."""

import socket
import struct
import time

import pytest
import torch
import zmq
from zmq_helpers import Served, pool

from measure.pools import fill_random_sequence
from protocol.curve import kv_keys
from transfer import errors as E
from transfer.channels.zmq_channel import ZmqSender
from transfer.transport import TransportConfig

SECRET = "issue-49-cluster-secret"
# ZMTP 3.0 as a plain (NULL mechanism) DEALER speaks it: greeting, then its READY command
GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32
READY = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
FRAME_BYTES, FRAMES = 16 << 20, 4  # 64 MiB in frames marked "more", never finished


def _unfinished_multipart(port: int) -> int:
    """Greet as a plain ZeroMQ peer and send FRAMES frames of one never-finished message; returns the
    bytes of them the receiver took before it closed the connection."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    taken, body = 0, bytes(FRAME_BYTES)
    try:
        s.sendall(GREETING + bytes([0x04, len(READY)]) + READY)
        for _ in range(FRAMES):
            s.sendall(struct.pack(">BQ", 0x03, FRAME_BYTES))  # flags: more | long size
            s.sendall(body)
            taken += FRAME_BYTES
    except OSError:  # closed (reset) by the receiver
        pass
    finally:
        s.close()
    return taken


def _wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


@pytest.fixture
def src():
    manager = pool()
    fill_random_sequence(manager, "a", 40, torch.Generator().manual_seed(49))
    return manager


def test_a_peer_without_the_key_cannot_make_the_receiver_hold_an_unfinished_message(src):
    served = Served(pool(), secret=SECRET, preauth_s=60.0)  # the pre-handshake cut cannot end it here
    try:
        port = int(served.rx.address.rsplit(":", 1)[1])
        assert _unfinished_multipart(port) < FRAMES * FRAME_BYTES  # dropped in ZeroMQ's handshake
        assert _wait_for(lambda: served.metrics.refusals["curve"] >= 1)  # counted as a refusal
        tx = ZmqSender(src.storage.layout.fingerprint(), TransportConfig(address=served.rx.address,
                                                                         secret=SECRET))
        try:  # a member still migrates
            assert tx.migrate(src, "a", "member", 1).request_id == "member"
            assert served.next().request_id == "member"
        finally:
            tx.close()
    finally:
        served.stop()


@pytest.mark.parametrize("secret", ["", "another-cluster"])
def test_a_sender_without_the_cluster_key_is_told_at_once(src, secret):
    served = Served(pool(), secret=SECRET)
    config = TransportConfig(address=served.rx.address, secret=secret, connect_timeout_s=300.0)
    tx = ZmqSender(src.storage.layout.fingerprint(), config)
    try:
        with pytest.raises(E.Unauthenticated, match="ZeroMQ handshake"):  # not a timeout 300 s later
            tx.connect()
        assert served.events.empty()  # nothing reached the protocol
    finally:
        tx.close()
        served.stop()


def test_the_kv_key_pair_is_derived_from_the_secret_alone():
    keys = kv_keys(SECRET)
    assert keys == kv_keys(SECRET) and keys != kv_keys(SECRET + "x")
    assert zmq.curve_public(keys.secret.encode()).decode() == keys.public
    with pytest.raises(ValueError):
        kv_keys("")



def test_a_migration_sent_after_a_failed_handshake_ends_with_its_cause(src):
    """libzmq drops a DEALER's connection for good when its side of the handshake fails for a
    protocol reason (here: the receiver greets with CURVE, the sender has no key), and a DEALER
    without a connection blocks on send: `bench chaos`'s forged-import fault (a manifest sent
    without a hello) hung there in CI. The send now ends with the handshake's cause. The receiver
    is a raw socket that greets as a CURVE server and then waits, so the sender is the side that
    sees the mismatch (against a real receiver either side may see it first)."""
    import threading

    from transfer.reblock import check_compatible

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    # ZMTP 3.0 greeting of a CURVE server: signature, version, mechanism, as-server, filler
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\x00") + b"\x01" \
        + b"\x00" * 31
    fp = src.storage.layout.fingerprint()
    tx = ZmqSender(fp, TransportConfig(address=f"tcp://127.0.0.1:{port}", connect_timeout_s=300.0))
    outcome = []

    def forge():
        try:
            tx.plan = check_compatible(fp, fp)  # as if the hello had passed
            outcome.append(tx.migrate(src, "a", "forged", 1, dedupe=False))
        except E.TransferError as e:
            outcome.append(e)

    listener.settimeout(30)
    conn, _ = listener.accept()
    try:
        conn.sendall(greeting)
        assert tx.channel.watch.monitor.poll(30_000)  # the sender's handshake failed; event unread
        t = threading.Thread(target=forge, daemon=True)
        t.start()
        t.join(120)  # a bound for a hang, far above the milliseconds this takes
        assert not t.is_alive(), "the send blocked on a socket without a connection"
        assert len(outcome) == 1 and isinstance(outcome[0], E.Unauthenticated)
        assert "mechanism mismatch" in str(outcome[0])
    finally:
        tx.close()
        conn.close()
        listener.close()
