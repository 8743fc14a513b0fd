"""Ownership ledger epochs and reconciliation; routing policies."""

import pytest

from coordinator.ledger import Ledger, LedgerError, Phase
from coordinator.router import NoWorkerError, Router, WorkerLoad


def test_every_move_bumps_the_epoch_and_stale_epochs_are_not_current():
    led = Ledger()
    led.open("r1")
    e1 = led.move("r1", Phase.PREFILLING, "prefill-0", blocks=3)
    e2 = led.move("r1", Phase.MIGRATING, "prefill-0", blocks=3)
    assert (e1, e2) == (1, 2)
    assert led.is_current("r1", 2) and not led.is_current("r1", 1)
    e3 = led.move("r1", Phase.DECODING, "decode-0", blocks=4)
    assert not led.is_current("r1", e2)  # a late transfer under the old epoch is refused
    assert led.owned_blocks() == {"decode-0": 4}
    led.close("r1", ok=True)
    assert not led.is_current("r1", e3)
    assert led.summary()["active_requests"] == 0 and led.summary()["finished"] == 1
    with pytest.raises(LedgerError, match="finished"):
        led.move("r1", Phase.DECODING, "decode-0")


def test_reconcile_reports_differences():
    led = Ledger()
    led.open("a")
    led.move("a", Phase.DECODING, "d0", blocks=5)
    assert led.reconcile({"d0": 5, "p0": 0}) == {}
    assert led.reconcile({"d0": 6, "p0": 1}) == {"d0": (5, 6), "p0": (0, 1)}
    with pytest.raises(LedgerError):
        led.open("a")
    with pytest.raises(LedgerError, match="unknown"):
        led.move("zz", Phase.DECODING, "d0")


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
