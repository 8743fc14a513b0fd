"""The prefill worker's hold, in process (no Ray): a request whose migration fails keeps its blocks
for a resend; an abort releases them at once and `hold_s` without a resend releases them too
(reported as `hold_expired`); the pool's integrity holds afterwards."""

from __future__ import annotations

import time

from engine.sampling import SamplingParams


def test_prefill_worker_releases_held_blocks_on_abort_and_on_hold_expiry():
    import zmq

    from prefill_worker.worker import PrefillWorker
    from protocol.codec import decode, encode
    from protocol.messages import Abort, RequestFailed, Resend, Submit

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    addr = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    w = PrefillWorker({"name": "p", "events_address": addr, "engine": {"model": "tiny", "num_blocks": 32},
                       "transfer_timeout_s": 1.0, "hold_s": 4.0})
    stats: dict = {}

    def until(pred, deadline_s: float = 30.0) -> list:
        seen, end = [], time.monotonic() + deadline_s
        while time.monotonic() < end:
            if pull.poll(200):
                report = decode(pull.recv())
                stats.update(report.stats)
                seen += report.events
                if pred(seen):
                    return seen
        raise AssertionError(f"condition not reached; events {seen}, stats {stats}")

    def failures(events) -> list:
        return [e for e in events if isinstance(e, RequestFailed)]

    try:
        params = SamplingParams(max_tokens=4)
        nowhere = "tcp://127.0.0.1:9"  # nothing listens: the handshake times out
        for rid in ("a", "b"):
            reply = decode(w.command(encode(Submit(rid, list(range(1, 40)), params, "decode-x", nowhere, 2))))
            assert reply.error == ""
        until(lambda evs: {e.request_id for e in failures(evs) if e.held} == {"a", "b"})
        until(lambda evs: stats["held_for_resend"] == 2)
        assert stats["used_blocks"] > 0 and stats["leases"] == 0
        w.command(encode(Abort("b")))
        until(lambda evs: stats["held_for_resend"] == 1)
        reply = decode(w.command(encode(Resend("b", "decode-x", nowhere, 4))))
        assert reply.error == "request b is not held on p"
        evs = until(lambda evs: any(e.kind == "hold_expired" for e in failures(evs)))
        assert [e.request_id for e in failures(evs)] == ["a"]
        until(lambda evs: stats["held_for_resend"] == 0)
        assert stats["used_blocks"] == 0 and stats["hold_expired"] == 1 and stats["prefills"] == 2
        w.engine.kv.check_integrity()
    finally:
        w.shutdown()
        pull.close(0)
        ctx.term()
