"""The exhaustive mode (dst.explore): the small case - one prefill, one decode, one request, at
most one fault of any kind at any of its messages, every delivery order - is explored completely
with no invariant broken; the historical `reoffer` bug (81cf81a), which needs two faults on one
message and one delivery order, is found within a stated number of runs and replays from its
choices, which the real code survives."""

from dst.explore import explore

REOFFER_WITHIN = 2000  # runs; first found at run 986 (dup + corrupt on the pool offer, 8 messages)


def test_the_small_case_is_explored_completely_and_holds():
    report = explore(requests=1, max_faults=1, max_messages=40, time_limit_s=300)
    assert report["violation"] is None
    assert report["complete"] and report["states"] > 100


def test_the_reoffer_bug_is_found_exhaustively_and_replays():
    case = {"requests": 1, "max_faults": 2, "max_messages": 8, "kinds": ("dup", "corrupt")}
    found = explore(**case, mutant_name="reoffer", max_runs=REOFFER_WITHIN)["violation"]
    assert found is not None and "AttributeError" in found["violation"]
    again = explore(**case, mutant_name="reoffer", max_runs=1, first=found["choices"])["violation"]
    assert again is not None and again["violation"] == found["violation"]
    assert explore(**case, max_runs=1, first=found["choices"])["violation"] is None
