"""A decode worker killed mid-stream while the prompt is still being computed, on a local Ray
cluster (ZeroMQ): the prefill worker's engine is paused after its second prefill chunk (a test
wrapper around `engine.step`, installed in the actor) and its stream after the first blocks
(`MigrationThreads.hold_streams`), so the stream breaks on the dead decode worker before its final state
exists. The stream is not restarted; the prefill finishes, the whole migration to the dead worker
fails, the held blocks are re-sent to the other decode worker (no second prefill), and the client
gets the local engine's greedy tokens. Helpers and probes: test_stream_failover.py.
"""

from __future__ import annotations

import concurrent.futures
import sys

import pytest

pytest.importorskip("ray")

import cluster_client as cc  # noqa: E402
import test_stream_failover as sf  # noqa: E402

from coordinator.cluster import ClusterConfig  # noqa: E402

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module", autouse=True)
def _probes_by_value():
    from ray import cloudpickle

    for module in (sf, sys.modules[__name__]):
        cloudpickle.register_pickle_by_value(module)
    yield
    for module in (sf, sys.modules[__name__]):
        cloudpickle.unregister_pickle_by_value(module)


def _pause_after(actor, steps: int) -> None:
    """The engine's step number `steps + 1` (and later ones) waits until `_resume` (bounded)."""
    import threading

    engine, real = actor.engine, actor.engine.step
    actor.test_gate, actor.test_paused, done = threading.Event(), threading.Event(), [0]

    def step():
        if done[0] >= steps and engine.requests:
            actor.test_paused.set()
            actor.test_gate.wait(60)
        done[0] += 1
        return real()
    engine.step = step


def _paused(actor) -> bool:
    return actor.test_paused.is_set()


def _resume(actor) -> None:
    actor.test_gate.set()


def _record_posts(actor) -> None:
    """Keep (request id, error type) of every MigrationResult the migration threads hand to the loop."""
    migration_threads, real = actor.handler.migration_threads, actor.handler.migration_threads.post
    actor.test_posted = []

    def post(done):
        actor.test_posted.append((done.job.rid, type(done.error).__name__ if done.error else None))
        real(done)
    migration_threads.post = post


def _posted(actor) -> list:
    return list(actor.test_posted)


def test_decode_killed_while_the_prompt_computes_the_broken_stream_falls_back_and_is_resent(
        ray_local, local_engine):
    want = cc.greedy_ids(local_engine, sf.PROMPT, max_tokens=8, ignore_eos=True)
    srv = sf.ClusterServer(ClusterConfig(prefill=1, decode=2, num_blocks=128, heartbeat_timeout_s=3.0,
                                         max_restarts=0, engine=sf.STEP))
    try:
        port = srv.start()
        for probe in (sf._hold, _record_posts):
            sf.on(srv, "prefill-0", probe)
        sf.on(srv, "prefill-0", _pause_after, 2)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(cc.complete, port, {"prompt": sf.PROMPT, **sf.GREEDY})
            _, rid = sf.held_stream(srv, ["prefill-0"])
            sf.until(lambda: sf.on(srv, "prefill-0", _paused), "the engine to pause after two chunks")
            assert not sf.on(srv, "prefill-0", sf._finalized, rid)  # 64 of 200 tokens computed
            decodes = ["decode-0", "decode-1"]
            victim, _ = sf.until(lambda: next(((n, s) for n in decodes if (s := sf.landing(srv, n))), None),
                                 "the offer landing")
            other = next(n for n in decodes if n != victim)
            sf.kill(srv, victim)
            sf.on(srv, "prefill-0", sf._release)  # its next blocks go to a dead worker
            posted = sf.until(lambda: sf.on(srv, "prefill-0", _posted), "the broken stream's result")
            assert posted[0][0] == rid and posted[0][1] is not None, posted
            sf.on(srv, "prefill-0", _resume)
            got = fut.result(timeout=120)
        assert got["choices"][0]["token_ids"] == want
        backend = got["pdserve"]["backend"]
        assert (backend["decode_worker"], backend["resent"], backend["migration"]["to"]) == (other, 1, other)
        ws = sf._at_rest(srv, failed=0, dead=(victim,))
        prefill = ws["prefill-0"]
        assert (prefill["prefills"], prefill["resends"]) == (1, 1)
        assert (prefill["streamed_migrations"], prefill["stream_fallbacks"]) == (1, 1)  # not restarted
    finally:
        srv.stop()
