"""Ownership ledger epochs and reconciliation; routing policies."""

import pytest

from coordinator.ledger import Ledger, LedgerError, Phase
from coordinator.router import NoWorkerError, Router, WorkerLoad


def test_every_move_bumps_the_epoch_and_blocks_come_from_worker_reports():
    led = Ledger()
    led.open("r1")
    e1 = led.move("r1", Phase.PREFILLING, "prefill-0")
    led.record("prefill-0", {"r1": 3})
    assert led.owned_blocks() == {"prefill-0": 3}
    e2 = led.move("r1", Phase.MIGRATING, "decode-0")
    assert (e1, e2) == (1, 2)
    led.record("decode-0", {"r1": 4})  # both hold blocks while the KV moves
    assert led.owned_blocks() == {"prefill-0": 3, "decode-0": 4}
    led.record("prefill-0", {})         # the prefill worker released them after the ack
    led.move("r1", Phase.DECODING, "decode-0")
    led.record("decode-0", {"r1": 6, "not-in-ledger": 2})  # decode growth; unknown ids are ignored
    assert led.owned_blocks() == {"decode-0": 6}
    assert led.get("r1").epoch == 3
    led.close("r1", ok=True)
    assert led.owned_blocks() == {} and led.get("r1").blocks == {}
    assert led.summary()["active_requests"] == 0 and led.summary()["finished"] == 1
    with pytest.raises(LedgerError, match="finished"):
        led.move("r1", Phase.DECODING, "decode-0")
    with pytest.raises(LedgerError):
        led.open("r1")
    with pytest.raises(LedgerError, match="unknown"):
        led.move("zz", Phase.DECODING, "d0")


def _reconciler(monkeypatch, start: float = 0.0):
    """(clock, ledger, counted kinds, Reconciler with a 1 s grace) on a clock the test moves by hand."""
    import coordinator.reconcile as rec

    now = [start]
    monkeypatch.setattr(rec.time, "monotonic", lambda: now[0])
    led, counted = Ledger(), []
    return now, led, counted, rec.Reconciler(led, grace_s=1.0, count=counted.append)


def test_reconciler_counts_and_repairs_only_what_outlives_the_grace(monkeypatch):
    now, led, counted, reconciler = _reconciler(monkeypatch, 100.0)
    for rid in ("live", "gone"):
        led.open(rid)
        led.move(rid, Phase.DECODING, "d0")
    assigned = {"live": {"p0", "d0"}, "gone": {"p0", "d0"}}
    assert reconciler.check("d0", "decode", {"used_blocks": 5}, {"live": 4, "gone": 1}, assigned) == ([], [])
    holdings = {"live": 4, "ghost": 2}  # "gone" vanished from d0; "ghost" is nobody's request
    stats = {"used_blocks": 7}          # and one block no request accounts for
    assert reconciler.check("d0", "decode", stats, holdings, assigned) == ([], [])
    now[0] += 0.5
    assert reconciler.check("d0", "decode", stats, holdings, assigned) == ([], [])  # within the grace
    assert counted == []
    now[0] += 0.6
    assert reconciler.check("d0", "decode", stats, holdings, assigned) == (["ghost"], ["gone"])
    assert sorted(counted) == ["orphan", "unowned", "vanished"]
    led.close("gone", ok=False)  # what the coordinator does with a vanished request
    now[0] += 0.1  # resolved by then: forgotten, never counted again
    assert reconciler.check("d0", "decode", {"used_blocks": 4}, {"live": 4}, {"live": {"d0"}}) == ([], [])
    now[0] += 5
    assert reconciler.check("d0", "decode", {"used_blocks": 4}, {"live": 4}, {"live": {"d0"}}) == ([], [])
    assert len(counted) == 3


def test_round_robin_skips_dead_and_excluded_workers():
    r = Router("round_robin")
    ws = [WorkerLoad("w0"), WorkerLoad("w1", alive=False), WorkerLoad("w2")]
    picks = [r.pick(ws, "decode") for _ in range(4)]
    assert picks == ["w0", "w2", "w0", "w2"]
    assert r.pick(ws, "decode", exclude={"w0"}) == "w2"
    with pytest.raises(NoWorkerError, match="no live prefill worker"):
        r.pick([WorkerLoad("x", alive=False)], "prefill")


def test_least_loaded_prefers_free_blocks_then_short_queue():
    r = Router("least_loaded")
    ws = [WorkerLoad("a", free_blocks=10, queue_depth=0), WorkerLoad("b", free_blocks=30, queue_depth=5),
          WorkerLoad("c", free_blocks=30, queue_depth=1)]
    assert r.pick(ws, "prefill") == "c"


def test_prefix_aware_sends_a_shared_prefix_to_the_same_worker():
    r = Router("prefix_aware")
    ws = [WorkerLoad("a", free_blocks=50, block_size=4), WorkerLoad("b", free_blocks=60, block_size=4)]
    prefix = list(range(40))
    first = r.pick(ws, "prefill", prefix + [1, 2])
    assert first == "b"  # nothing cached anywhere: least loaded
    ws[1].free_blocks = 10  # b is now busier, but holds the prefix
    assert r.pick(ws, "prefill", prefix + [7, 8, 9]) == "b"
    assert r.pick(ws, "prefill", [99] * 20) == "a"  # unrelated prompt: least loaded


def test_reconciler_waits_for_reports_not_only_time(monkeypatch):
    """A worker busy for seconds (a migration) reports a queued Submit only in its next reports:
    a request missing from two reports spread over 2 s is not yet a discrepancy."""
    now, led, counted, reconciler = _reconciler(monkeypatch)
    led.open("queued")
    led.move("queued", Phase.PREFILLING, "p0")
    assigned = {"queued": {"p0", "d0"}}
    assert reconciler.check("p0", "prefill", {"used_blocks": 0}, {}, assigned) == ([], [])
    now[0] += 2.0  # the worker's loop was busy: its next report still lacks the request
    assert reconciler.check("p0", "prefill", {"used_blocks": 0}, {}, assigned) == ([], [])
    assert reconciler.check("p0", "prefill", {"used_blocks": 0}, {"queued": 0}, assigned) == ([], [])
    assert counted == []


def test_a_request_its_worker_never_listed_has_not_vanished(monkeypatch):
    """Ray delivers a Submit behind slower calls, seconds late on a loaded machine, while the worker
    keeps reporting: until the worker lists the request under its current epoch, nothing vanished.
    Listed once, then missing from three reports over more than the grace: vanished."""
    now, led, counted, reconciler = _reconciler(monkeypatch)
    led.open("late")
    led.move("late", Phase.PREFILLING, "p0")
    assigned = {"late": {"p0", "d0"}}
    for _ in range(10):  # five seconds of reports without it
        now[0] += 0.5
        assert reconciler.check("p0", "prefill", {"used_blocks": 0}, {}, assigned) == ([], [])
    assert counted == []
    assert reconciler.check("p0", "prefill", {"used_blocks": 2}, {"late": 2}, assigned) == ([], [])
    results = []
    for _ in range(3):
        now[0] += 0.6
        results.append(reconciler.check("p0", "prefill", {"used_blocks": 0}, {}, assigned))
    assert results == [([], []), ([], []), ([], ["late"])] and counted == ["vanished"]
    # a retry under a new epoch on the same worker starts unlisted again
    led.move("late", Phase.PREFILLING, "p0")
    now[0] += 5
    later = [reconciler.check("p0", "prefill", {"used_blocks": 0}, {}, assigned) for _ in range(3)]
    assert later == [([], [])] * 3


def test_a_request_whose_every_token_arrived_has_not_vanished(monkeypatch):
    """The decode worker finished the request and freed its blocks; the coordinator still waits for
    the prefill worker's report of the migration (seconds late from a busy prefill worker). Its
    absence from the decode worker's reports is no discrepancy; without every token it would be."""
    now, led, counted, reconciler = _reconciler(monkeypatch)
    led.open("done")
    led.move("done", Phase.DECODING, "d0")
    assigned = {"done": {"p0", "d0"}}
    assert reconciler.check("d0", "decode", {"used_blocks": 2}, {"done": 2}, assigned) == ([], [])
    for _ in range(5):
        now[0] += 0.6
        got = reconciler.check("d0", "decode", {"used_blocks": 0}, {}, assigned, frozenset({"done"}))
        assert got == ([], [])
    assert counted == []
    results = []
    for _ in range(3):
        now[0] += 0.6
        results.append(reconciler.check("d0", "decode", {"used_blocks": 0}, {}, assigned))
    assert results[-1] == ([], ["done"]) and counted == ["vanished"]
