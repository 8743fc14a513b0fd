"""Issue 49, item 2: a bulk link that cannot be filled. When the receiver will not open a bulk
link (its slots are taken), a whole or streamed migration goes on the control socket instead,
counted, and lands bit-exact; and a flood of half-finished connections to the data-stream port,
re-opened as fast as they are cut, costs migrations that each re-open their stream nothing.
Attacks go to loopback, bounded in threads and time; waits are bounded; nothing asserts a speed."""

import socket
import threading

import pytest
import torch
from channel_harness import feed
from zmq_helpers import Served, kv_bytes, pool

from measure.pools import fill_random_sequence
from transfer.channels import bulk_receiver
from transfer.channels.zmq_channel import ZmqSender
from transfer.metrics import TransferMetrics
from transfer.transport import TransportConfig
from transfer.wire_messages import DecodeState

FLOOD_THREADS = 96  # more than bulk_open.MAX_OPENING (64)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(49)


def _sender(served, metrics):
    config = TransportConfig(address=served.rx.address, inline_bytes=0)  # every payload takes the stream
    return ZmqSender(served.manager.storage.layout.fingerprint(), config, metrics=metrics)


def test_a_stream_the_receiver_will_not_open_falls_back_to_the_control_socket(gen, monkeypatch):
    monkeypatch.setattr(bulk_receiver, "MAX_LINKS", 0)  # every opening is told "busy"
    src = pool(num_blocks=64)
    tokens = fill_random_sequence(src, "a", 200, gen)
    served, sent = Served(pool(num_blocks=128), auto_free=True), TransferMetrics()
    tx = _sender(served, sent)
    try:
        assert tx.migrate(src, "a", "whole", 1, dedupe=False).request_id == "whole"
        assert served.next().request_id == "whole"
        final = DecodeState(tokens + [7], {"max_tokens": 4, "temperature": 0.0}, 1)
        blocks = feed(src.table("a"), 13, final)
        ack = tx.migrate_streamed(src, "streamed", 1, tokens, {"max_tokens": 4}, blocks)
        assert ack.request_id == "streamed"
        landed = served.next()
        assert sent.counters["data_stream_fallbacks"] == 2  # said and counted, not silent
        assert served.kv[landed.seq_id].equal(kv_bytes(src, "a"))  # the same bytes, another path
        assert served.metrics.counters["streams_refused"] == 2
    finally:
        tx.close()
        served.stop()


def _flood(port: int, stop: threading.Event) -> None:
    """Re-open a half-finished (1-byte) opening as soon as the receiver cuts the last one."""
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(b"P")
                s.recv(1)  # the receiver cuts it (busy, or its opening deadline)
        except OSError:
            pass


def test_a_reconnecting_flood_of_half_openings_costs_migrations_nothing(gen):
    src = pool(num_blocks=64)
    fill_random_sequence(src, "a", 200, gen)
    served, sent = Served(pool(num_blocks=128), auto_free=True), TransferMetrics()
    tx = _sender(served, sent)
    stop = threading.Event()
    flood = [threading.Thread(target=_flood, args=(served.rx.bulk.port, stop), daemon=True)
             for _ in range(FLOOD_THREADS)]
    try:
        tx.migrate(src, "a", "before", 1, dedupe=False)  # the handshake, before the flood
        served.next()
        for t in flood:
            t.start()
        for i in range(8):
            tx.channel.close_bulk()  # as a cancelled streamed migration does: the next one re-opens
            assert tx.migrate(src, "a", f"during-{i}", 1, dedupe=False).request_id == f"during-{i}"
            assert served.next().request_id == f"during-{i}"
    finally:
        stop.set()
        for t in flood:
            t.join(10)
        tx.close()
        served.stop()
