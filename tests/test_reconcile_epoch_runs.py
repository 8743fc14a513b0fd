"""A request rerun under a newer epoch on the same worker: the worker's listings of the older
attempt, and its reports sent before the move that arrive after it, are not listings of the new
attempt, so the older attempt ending does not make the new one vanish, whether those listings
began before the move or all arrive after it (found by the deterministic simulation, dst). A
request that becomes a worker's for the first time still vanishes when that worker stops listing
it."""

import logging

from coordinator.ledger import Ledger, Phase
from coordinator.reconcile import MIN_REPORTS, Reconciler


def _setup():
    logging.getLogger("coordinator.reconcile").setLevel(logging.ERROR)
    led = Ledger()
    reconciler = Reconciler(led, grace_s=-1.0, count=lambda kind: None)  # grace 0: reports alone count
    led.open("r")
    led.move("r", Phase.PREFILLING, "p0")
    return led, reconciler


def _report(reconciler, holdings):
    return reconciler.check("p0", "prefill", {"used_blocks": sum(holdings.values())}, holdings,
                            {"r": {"p0", "d0"}})[1]


def test_listings_that_began_before_a_rerun_do_not_make_the_rerun_vanish():
    led, reconciler = _setup()
    assert _report(reconciler, {"r": 2}) == []       # the first attempt, listed
    led.move("r", Phase.PREFILLING, "p0")             # rerun on the same worker, a newer epoch
    for _ in range(2):
        assert _report(reconciler, {"r": 2}) == []   # late reports of the first attempt
    for _ in range(MIN_REPORTS + 1):
        assert _report(reconciler, {}) == []         # the first attempt ended; the rerun's Submit is late
    assert _report(reconciler, {"r": 2}) == []       # the rerun arrives


def test_a_wholly_late_listing_run_of_the_older_attempt_is_not_the_rerun_vanishing():
    led, reconciler = _setup()
    led.move("r", Phase.PREFILLING, "p0")             # rerun before any report listed the first attempt
    for _ in range(2):
        assert _report(reconciler, {"r": 2}) == []   # every report of the first attempt arrives late
    for _ in range(MIN_REPORTS + 1):
        assert _report(reconciler, {}) == []


def test_a_request_listed_by_the_worker_it_became_and_then_lost_vanishes():
    led, reconciler = _setup()
    assert _report(reconciler, {"r": 2}) == []
    found = [_report(reconciler, {}) for _ in range(MIN_REPORTS)]
    assert found[-1] == ["r"]
