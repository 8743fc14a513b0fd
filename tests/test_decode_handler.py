"""The decode role in process (no Ray): a reserved import whose manifest passes the wire schema but
that the engine cannot run (token ids outside the vocabulary) is refused with a typed event, its
blocks are freed uncached, and the loop keeps serving; a good import from the same sender then
joins the batch and streams tokens."""

from __future__ import annotations

import torch
from worker_harness import in_process

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
    with in_process(DecodeWorker, {"name": "decode-t", "engine": {"num_blocks": 32}}) as (worker, reports):
        fp = worker.engine.storage.layout.fingerprint()
        layout = KVLayout(fp["num_layers"], fp["num_kv_heads"], fp["head_dim"], fp["block_size"], fp["dtype"],
                          fp["model"])
        source = make_manager(layout, 16)
        gen = torch.Generator().manual_seed(1)
        config = TransportConfig(address=worker.handler.address, peer_name="p")
        sender = ZmqSender(layout.fingerprint(), config)
        try:
            params = SamplingParams(max_tokens=4, ignore_eos=True).to_dict()
            for rid, first in (("bad", 600), ("good", 100)):  # the tiny vocabulary has 512 ids
                tokens = list(range(first, first + 20))
                fill_random_sequence(source, rid, len(tokens), gen, tokens)
                assert decode(worker.command(encode(Reserve(rid, 1, 21, 1, "p")))).granted
                sender.migrate(source, rid, f"{rid}/0", 1, DecodeState(tokens + [5], params, 1), dedupe=False)
        finally:
            sender.close()
        def good_finished() -> bool:
            return any(isinstance(e, Tokens) and e.request_id == "good" and e.finish_reason
                       for e in reports.events)
        events = reports.until(good_finished)
        refused = [e for e in events if isinstance(e, RequestFailed)]
        assert [(e.request_id, e.kind) for e in refused] == [("bad", "refused")]
        assert "vocabulary" in refused[0].message
        assert [e.request_id for e in events if isinstance(e, Imported)] == ["good"]
        assert worker.loop.alive() and reports.stats["refused_imports"] == 1
        reports.until(lambda: reports.stats.get("used_blocks") == 0)
        good_hashes = set(worker.engine.kv.prefix_hashes(list(range(100, 120))))
        assert not worker.engine.kv.allocator.cached_hashes() - good_hashes  # the bad import left no hash
