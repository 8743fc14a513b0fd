"""The decode role in process (no Ray): a reserved import whose manifest passes the wire schema but
that the engine cannot run (token ids outside the vocabulary) is refused with a typed event, its
blocks are freed uncached, and the loop keeps serving; a good import from the same sender then
joins the batch and streams tokens. An n=2 request's second sequence, shipped after the first's
ack, is imported before the request's first step; one that never comes only delays it."""

from __future__ import annotations

import time

import torch
from worker_harness import in_process

from decode_worker.worker import DecodeWorker
from kvcache.storage import KVLayout
from measure.pools import fill_random_sequence, make_manager
from protocol.codec import decode, encode
from protocol.messages import Imported, RequestFailed, Reserve, Tokens
from protocol.sampling import SamplingParams
from transfer.channels.zmq_channel import ZmqSender
from transfer.transport import TransportConfig
from transfer.wire_messages import DecodeState


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


def _pair_worker(sibling_wait_s: float):
    return in_process(DecodeWorker, {"name": "decode-n2", "engine": {"num_blocks": 32},
                                     "sibling_wait_s": sibling_wait_s})


def _ship(worker, sender, source, gen, index: int) -> None:
    """Sequence `index` of request "pair" (n=2), filled on the source and migrated."""
    tokens = list(range(100 + 30 * index, 120 + 30 * index))
    fill_random_sequence(source, f"pair-{index}", len(tokens), gen, tokens)
    params = SamplingParams(max_tokens=4, ignore_eos=True).to_dict()
    state = DecodeState(tokens + [5], params, 1)
    sender.migrate(source, f"pair-{index}", f"pair/{index}", 1, state, dedupe=False)


def _pair_setup(worker):
    fp = worker.engine.storage.layout.fingerprint()
    layout = KVLayout(fp["num_layers"], fp["num_kv_heads"], fp["head_dim"], fp["block_size"], fp["dtype"],
                      fp["model"])
    sender = ZmqSender(layout.fingerprint(), TransportConfig(address=worker.handler.address, peer_name="p"))
    assert decode(worker.command(encode(Reserve("pair", 1, 21, 2, "p")))).granted
    return make_manager(layout, 16), torch.Generator().manual_seed(2), sender


def _finished(reports, indices) -> bool:
    done = {e.index for e in reports.events if isinstance(e, Tokens) and e.finish_reason}
    return set(indices) <= done


def test_an_n2_request_waits_for_its_second_sequence_before_stepping():
    """The prefill worker ships sequence 1 only after sequence 0's ack: the loop must not start a
    step in between (that step would hold sequence 1's transfer), so no token of the request
    comes out before sequence 1 is imported, though it arrives 0.3 s later."""
    with _pair_worker(sibling_wait_s=10.0) as (worker, reports):
        source, gen, sender = _pair_setup(worker)
        try:
            _ship(worker, sender, source, gen, 0)
            time.sleep(0.3)
            _ship(worker, sender, source, gen, 1)
        finally:
            sender.close()
        events = reports.until(lambda: _finished(reports, (0, 1)))
        kinds = [(type(e).__name__, e.index) for e in events if isinstance(e, (Imported, Tokens))]
        assert kinds.index(("Imported", 1)) < min(i for i, k in enumerate(kinds) if k[0] == "Tokens")


def test_a_sibling_that_never_comes_delays_the_first_step_only_by_the_bound():
    with _pair_worker(sibling_wait_s=0.2) as (worker, reports):
        source, gen, sender = _pair_setup(worker)
        try:
            _ship(worker, sender, source, gen, 0)
        finally:
            sender.close()
        reports.until(lambda: _finished(reports, (0,)))
        assert worker.loop.alive() and worker.handler.due == {"pair": 1}
