"""A busy worker is not a dead worker: the step pacer sizes steps by time, a worker's heartbeat
comes from its own thread with the loop's progress, and the coordinator tells busy (a long step
its measured rate explains) from wedged (no progress past that bound) from dead (no heartbeat).
Pure-Python pieces here; tests/test_cluster_burst.py runs the SmolLM2 burst on a real cluster.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.workers import WEDGE_FACTOR, WorkerState
from engine.step_pacer import FIRST_BUDGET, MIN_BUDGET, StepPacer
from protocol.codec import decode, encode
from protocol.messages import Heartbeat


def test_pacer_fits_fixed_plus_per_token_and_budgets_to_the_target():
    pacer = StepPacer(target_s=0.25, max_tokens=2048)
    assert pacer.budget() == FIRST_BUDGET and pacer.expected_s(100) is None
    for tokens in (256, 64, 128, 32, 200, 16):  # a machine at 40 ms fixed + 4 ms per token
        pacer.observe(tokens, 0.040 + 0.004 * tokens)
    fixed, per_token = pacer.line()
    assert fixed == pytest.approx(0.040, rel=1e-6) and per_token == pytest.approx(0.004, rel=1e-6)
    assert pacer.budget() == int((0.25 - 0.040) / 0.004)  # 52 tokens take 0.25 s there
    assert pacer.expected_s(1000) == pytest.approx(4.04)


def test_pacer_is_capped_and_floored_and_off_at_zero():
    fast = StepPacer(0.25, max_tokens=2048)
    for tokens in (64, 256, 512):
        fast.observe(tokens, 1e-5 * tokens)
    assert fast.budget() == 2048  # a fast machine: the configured cap
    slow = StepPacer(0.25, max_tokens=2048)
    for tokens in (8, 32, 64):
        slow.observe(tokens, 0.5 + 0.01 * tokens)  # fixed cost alone is over the target
    assert slow.budget() == MIN_BUDGET
    off = StepPacer(0.0, max_tokens=2048)
    off.observe(100, 50.0)
    assert off.budget() == 2048
    with pytest.raises(ValueError):
        StepPacer(-1.0, 10)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4096), st.floats(1e-4, 30.0)), min_size=1, max_size=40),
       st.floats(0.0, 2.0), st.integers(1, 8192))
def test_pacer_budget_always_within_bounds(steps, target, cap):
    pacer = StepPacer(target, cap)
    for tokens, seconds in steps:
        pacer.observe(tokens, seconds)
        assert min(MIN_BUDGET, cap) <= pacer.budget() <= cap
        fixed, per_token = pacer.line()
        assert fixed >= 0 and per_token > 0


def _worker(**progress) -> WorkerState:
    w = WorkerState("prefill-0", "prefill", handle=None)
    w.beat(Heartbeat("prefill-0", loop_alive=True, **progress))
    return w


def test_long_step_that_the_rate_explains_is_busy_not_dead():
    # 8 s into a 2000-token step that should take 6 s: past the 5 s floor, within 4 x 6 s
    w = _worker(busy_s=8.0, step_tokens=2000, step_expected_s=6.0)
    assert w.alive(5.0) and w.why_not_alive(5.0) is None


def test_loop_stuck_past_its_bound_is_wedged():
    w = _worker(busy_s=6.0, step_tokens=0, step_expected_s=0.0)  # no step: the floor applies
    assert not w.alive(5.0) and "wedged" in w.why_not_alive(5.0)
    w = _worker(busy_s=4 * WEDGE_FACTOR + 1, step_tokens=100, step_expected_s=4.0)
    assert "wedged" in w.why_not_alive(5.0) and "100 tokens" in w.why_not_alive(5.0)
    w = _worker(busy_s=1.0, step_tokens=0, step_expected_s=0.0)  # a late heartbeat: starved, not stuck
    w.last_seen -= 4.5
    assert w.why_not_alive(5.0) is None


def test_silence_and_a_dead_loop_are_dead():
    w = _worker(busy_s=0.0, step_tokens=0, step_expected_s=0.0)
    w.last_seen = time.monotonic() - 6.0
    assert "no heartbeat" in w.why_not_alive(5.0)
    w = WorkerState("decode-0", "decode", handle=None)
    w.beat(Heartbeat("decode-0", loop_alive=False, busy_s=0.0, step_tokens=0, step_expected_s=0.0))
    assert "loop ended" in w.why_not_alive(5.0)


def test_heartbeat_round_trips_the_codec():
    beat = Heartbeat("decode-1", True, 1.5, 300, 0.75)
    assert decode(encode(beat)) == beat


def test_heartbeats_keep_coming_while_the_loop_is_wedged_and_say_so():
    """A real worker body (no Ray) with its loop wedged by the 'hang' fault: its heartbeat thread
    keeps reporting, with busy_s growing past the floor, so the coordinator's WorkerState calls it
    wedged (not silent); before the hang it is alive."""
    from worker_harness import in_process

    from colocated_worker.worker import ColocatedWorker

    with in_process(ColocatedWorker, {"name": "colo-hb", "heartbeat_s": 0.05,
                                      "engine": {"num_blocks": 16}}) as (worker, reports):
        state = WorkerState("colo-hb", "colocated", handle=None)
        reports.until(lambda: len(reports.heartbeats) >= 3)
        for beat in reports.heartbeats:
            state.beat(beat)
        assert state.alive(0.5) and reports.heartbeats[-1].loop_alive
        worker.inject_fault("hang")
        reports.until(lambda: reports.heartbeats[-1].busy_s > 0.6)
        state.beat(reports.heartbeats[-1])
        assert "wedged" in state.why_not_alive(0.5)
        assert time.monotonic() - state.last_seen < 0.5  # not silent: its process is alive
        worker.shutdown()


def test_worker_metrics_export_kv_refusals_and_the_step_budget():
    from coordinator.metrics import worker_metrics_text

    text = worker_metrics_text([{"name": "decode-0", "role": "decode", "kv_refused_limits": 3,
                                 "kv_refused_malformed": 1, "kv_refusals": 4, "step_budget": 52}])
    assert 'pdserve_kv_refusals_total{reason="limits",role="decode",worker="decode-0"} 3.0' in text
    assert 'pdserve_kv_refusals_total{reason="malformed",role="decode",worker="decode-0"} 1.0' in text
    assert 'pdserve_worker_step_budget_tokens{role="decode",worker="decode-0"} 52.0' in text
