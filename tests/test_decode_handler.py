"""The decode role in process (no Ray): a reserved import whose manifest passes the wire schema but
that the engine cannot run (token ids outside the vocabulary) is refused with a typed event, its
blocks are freed uncached, and the loop keeps serving; a good import from the same sender then
joins the batch and streams tokens."""

from __future__ import annotations

import time

import torch
import zmq

from bench.pools import fill_random_sequence, make_manager
from decode_worker.worker import DecodeWorker
from kvcache.storage import KVLayout
from protocol.codec import decode, encode
from protocol.messages import Imported, RequestFailed, Reserve, Tokens
from protocol.sampling import SamplingParams
from transfer.messages import DecodeState
from transfer.transport import TransportConfig
from transfer.zmq_transport import ZmqSender


def test_a_bad_field_from_the_wire_is_refused_and_never_kills_the_loop():
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    address = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    worker = DecodeWorker({"name": "decode-t", "events_address": address, "engine": {"num_blocks": 32}})
    fp = worker.engine.storage.layout.fingerprint()
    layout = KVLayout(fp["num_layers"], fp["num_kv_heads"], fp["head_dim"], fp["block_size"], fp["dtype"],
                      fp["model"])
    source = make_manager(layout, 16)
    gen = torch.Generator().manual_seed(1)
    sender = ZmqSender(layout.fingerprint(), TransportConfig(address=worker.handler.address, peer_name="p"))
    events, stats = [], {}

    def until(pred, deadline_s: float = 20.0):
        end = time.monotonic() + deadline_s
        while time.monotonic() < end and not pred():
            if pull.poll(100):
                report = decode(pull.recv())
                events.extend(report.events)
                stats.update(report.stats)
        assert pred(), (events, stats)

    try:
        params = SamplingParams(max_tokens=4, ignore_eos=True).to_dict()
        for rid, first in (("bad", 600), ("good", 100)):  # the tiny vocabulary has 512 ids
            tokens = list(range(first, first + 20))
            fill_random_sequence(source, rid, len(tokens), gen, tokens)
            assert decode(worker.command(encode(Reserve(rid, 1, 21, 1, "p")))).granted
            sender.migrate(source, rid, f"{rid}/0", 1, DecodeState(tokens + [5], params, 1), dedupe=False)
        until(lambda: any(isinstance(e, Tokens) and e.request_id == "good" and e.finish_reason
                          for e in events))
        refused = [e for e in events if isinstance(e, RequestFailed)]
        assert [(e.request_id, e.kind) for e in refused] == [("bad", "refused")]
        assert "vocabulary" in refused[0].message
        assert [e.request_id for e in events if isinstance(e, Imported)] == ["good"]
        assert worker.loop.alive() and stats["refused_imports"] == 1
        until(lambda: stats.get("used_blocks") == 0)
        assert not worker.engine.kv.allocator.cached_hashes() - {  # the bad import's hashes left the cache
            h for h in worker.engine.kv.prefix_hashes(list(range(100, 120)))}
    finally:
        sender.close()
        worker.shutdown()
        pull.close(0)
        ctx.term()
