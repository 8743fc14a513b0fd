"""The prefill worker's hold, in process (no Ray): a request whose migration fails keeps its blocks
for a resend; an abort releases them at once and `hold_s` without a resend releases them too
(reported as `hold_expired`); the pool's integrity holds afterwards."""

from __future__ import annotations

from worker_harness import in_process

from engine.sampling import SamplingParams
from prefill_worker.worker import PrefillWorker
from protocol.codec import decode, encode
from protocol.messages import Abort, RequestFailed, Resend, Submit, Tokens


def test_prefill_worker_releases_held_blocks_on_abort_and_on_hold_expiry():
    config = {"name": "p", "engine": {"model": "tiny", "num_blocks": 32}, "transfer_timeout_s": 1.0,
              "hold_s": 4.0}
    with in_process(PrefillWorker, config) as (worker, reports):
        def failures() -> list:
            return [e for e in reports.events if isinstance(e, RequestFailed)]

        params = SamplingParams(max_tokens=4)
        nowhere = "tcp://127.0.0.1:9"  # nothing listens: the handshake times out
        for rid in ("a", "b"):
            submit = Submit(rid, list(range(1, 40)), params, "decode-x", nowhere, 2)
            assert decode(worker.command(encode(submit))).error == ""
        reports.until(lambda: {e.request_id for e in failures() if e.held} == {"a", "b"}, 30)
        reports.until(lambda: reports.stats["held_for_resend"] == 2)
        assert reports.stats["used_blocks"] > 0 and reports.stats["migrations_in_flight"] == 0
        worker.command(encode(Abort("b")))
        reports.until(lambda: reports.stats["held_for_resend"] == 1)
        reply = decode(worker.command(encode(Resend("b", "decode-x", nowhere, 4))))
        assert reply.error == "request b is not held on p"
        reports.until(lambda: any(e.kind == "hold_expired" for e in failures()), 30)
        assert [e.request_id for e in failures() if not e.held] == ["a"]
        reports.until(lambda: reports.stats["held_for_resend"] == 0)
        stats = reports.stats
        assert stats["used_blocks"] == 0 and stats["hold_expired"] == 1 and stats["prefills"] == 2
        worker.engine.kv.check_integrity()


def test_migrations_run_off_the_engine_loop_and_an_abort_in_flight_frees_on_return():
    """While one request's migration waits on an unresponsive decode worker (a transfer thread),
    the loop keeps prefilling and reporting; an Abort of the request in flight frees its blocks
    when the transfer returns, and nothing is held or leaked."""
    config = {"name": "p", "engine": {"model": "tiny", "num_blocks": 32}, "transfer_timeout_s": 3.0,
              "hold_s": 30.0}
    with in_process(PrefillWorker, config) as (worker, reports):
        def seen(kind, rid) -> bool:
            return any(isinstance(e, kind) and e.request_id == rid for e in reports.events)

        params = SamplingParams(max_tokens=4)
        nowhere = "tcp://127.0.0.1:9"  # nothing listens: the handshake waits out its timeout
        worker.command(encode(Submit("slow", list(range(1, 40)), params, "decode-x", nowhere, 1)))
        reports.until(lambda: reports.stats.get("migrations_in_flight") == 1, 10)
        worker.command(encode(Submit("next", list(range(50, 70)), params, "decode-y", nowhere, 1)))
        reports.until(lambda: seen(Tokens, "next"), 10)
        assert not any(isinstance(e, RequestFailed) for e in reports.events)  # "slow" is still in flight
        worker.command(encode(Abort("slow")))
        reports.until(lambda: seen(RequestFailed, "next"), 30)
        reports.until(lambda: reports.stats["migrations_in_flight"] == 0, 30)
        assert not seen(RequestFailed, "slow")  # aborted in flight: freed on return, not held or reported
        worker.command(encode(Abort("next")))
        reports.until(lambda: reports.stats["used_blocks"] == 0 and reports.stats["held_for_resend"] == 0, 30)
        worker.engine.kv.check_integrity()
