"""The exhaustive mode (dst.explore): the small case - one prefill, one decode, one request, at
most one fault of any kind its transport allows at any of its messages, every delivery order - is
explored completely under each registered transport's guarantees with no invariant broken; the
historical `reoffer` bug (81cf81a), which needs two faults on one message and one delivery order,
is found within a stated number of runs and replays from its choices, which the real code
survives; a pool read that lands after its transfer failed (mutant `late_read_lands`) is found
in a handful of runs where reads cannot be cancelled."""

import pytest

from dst.explore import explore
from transfer.registry import names

REOFFER_WITHIN = 2000  # runs; first found at run 1114 under ray (dup + corrupt on the pool offer, 8 messages)


@pytest.mark.parametrize("transport", names())
def test_the_small_case_is_explored_completely_and_holds(transport):
    report = explore(requests=1, max_faults=1, max_messages=40, time_limit_s=300, transport=transport)
    assert report["violation"] is None
    assert report["complete"] and report["states"] > 100
    assert "reorder" not in report["kinds"]  # every registered transport is ordered per caller


def test_a_late_read_that_lands_after_its_transfer_failed_is_found_exhaustively():
    case = {"requests": 1, "max_faults": 1, "max_messages": 40, "kinds": ("late_read",), "stage": False}
    found = explore(**case, transport="nixl", mutant_name="late_read_lands", max_runs=50)["violation"]
    assert found is not None and "written while free" in found["violation"]
    assert explore(**case, transport="nixl", max_runs=50)["violation"] is None  # the source stops it
    assert explore(**case, transport="zmq", mutant_name="late_read_lands")["kinds"] == []  # no pool read


def test_the_reoffer_bug_is_found_exhaustively_and_replays():
    case = {"requests": 1, "max_faults": 2, "max_messages": 8, "kinds": ("dup", "corrupt"),
            "transport": "ray"}  # a transport that reads the sender's pool
    found = explore(**case, mutant_name="reoffer", max_runs=REOFFER_WITHIN)["violation"]
    assert found is not None and "AttributeError" in found["violation"]
    again = explore(**case, mutant_name="reoffer", max_runs=1, first=found["choices"])["violation"]
    assert again is not None and again["violation"] == found["violation"]
    assert explore(**case, max_runs=1, first=found["choices"])["violation"] is None
