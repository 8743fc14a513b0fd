"""Worker deaths in the middle of a streamed migration, on a local Ray cluster whose 32-token step
budget splits the prompt into prefill chunks, over ZeroMQ and over Ray. The prefill workers'
transfer threads are paused by the test gate (`MigrationThreads.hold_streams`) right after a stream's
first blocks went out, so each kill hits a stream the decode worker holds open (blocks reserved,
landing), without racing a timer. A prefill worker killed mid-stream: the decode worker aborts
the stream whole (on ZeroMQ when its socket closes, on Ray when the rerun's offer supersedes it;
blocks and credit return, nothing is adopted) and the request reruns on the other prefill worker
with the local engine's greedy tokens, or, with none left, fails with a 503. A decode worker
killed mid-stream: the prefill worker finishes the prompt, keeps its blocks and re-sends them to
the other decode worker (no second prefill); the client gets the local engine's tokens. A prefill
worker frozen mid-stream (ZeroMQ; its stream open and silent, its loop wedged): the rerun's offer
supersedes the frozen stream on the same decode worker, and the client gets the local engine's
tokens. In process: a stream that failed while its prompt computed is not
restarted; the request migrates whole after its prefill.
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import time
import urllib.error

import pytest

pytest.importorskip("ray")

import cluster_client as cc  # noqa: E402

from coordinator.cluster import ClusterConfig  # noqa: E402
from deploy.launch import ClusterServer  # noqa: E402

pytestmark = pytest.mark.timeout(240)

PROMPT = [(j * 11) % 240 + 3 for j in range(200)]  # 7 prefill chunks, 13 blocks of 16
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
STEP = {"scheduler": {"max_num_batched_tokens": 32}}


@pytest.fixture(scope="module", autouse=True)
def _probes_by_value():
    """The probes below run inside the worker actors (__ray_call__), where this module is not importable."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


# ---- probes, run in a worker actor's process -----------------------------------------------------
def _hold(actor) -> None:
    actor.handler.migration_threads.hold_streams()


def _release(actor) -> None:
    actor.handler.migration_threads.release_streams()


def _held(actor) -> list[str]:
    return actor.handler.migration_threads.holding()


def _finalized(actor, rid: str) -> bool:
    flight = actor.handler.migrations.inflight.get(rid)
    return flight is not None and flight.finalized


def _decode_state(actor) -> dict:
    """Streams landing (transfer id, epoch, blocks), credits (request -> epoch, blocks), blocks used,
    sequences adopted, receiver errors. Off the loop thread: retried if a dict changed mid-walk."""
    h, rx = actor.handler, actor.handler.receiver
    for attempt in range(1000):
        try:
            if hasattr(rx, "_open_streams"):  # the Ray transport's streams, by connection
                sessions = [st.session for st in list(rx._open_streams.values())]
            else:
                sessions = [s for p in list(rx.active.values()) if (s := p.session) is not None]
            landing = sorted((s.manifest.request_id, s.manifest.epoch, len(s.dst_blocks)) for s in sessions)
            credits = {rid: (r.epoch, r.blocks_left) for rid, r in list(h.credits._reserved.items())}
            break
        except RuntimeError:
            assert attempt < 999, "the receiver's dicts kept changing under the walk"
    return {"landing": landing, "credits": credits, "used": h.engine.kv.allocator.num_used,
            "adopted": len(h.engine.requests), "errors": h.stats()["transfer_errors"]}


# ---- the test's side ------------------------------------------------------------------------------
def on(srv: ClusterServer, name: str, probe, *args):
    import ray
    return ray.get(srv.backend.workers[name].handle.__ray_call__.remote(probe, *args), timeout=30)


def until(probe, what: str, timeout_s: float = 60.0):  # probe()'s first truthy answer, bounded
    end = time.monotonic() + timeout_s
    while True:
        got = probe()
        if got:
            return got
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def kill(srv: ClusterServer, name: str) -> None:
    """Kill a worker's actor and wait (bounded) until its process is gone or a zombie: Ray may call
    the actor dead while the process still runs (and could still commit a stream) for a moment."""
    import ray

    pid = srv.backend.workers[name].info["pid"]
    ray.kill(srv.backend.workers[name].handle, no_restart=True)
    def gone() -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between open and read
            return True
    until(gone, f"{name} to die")


def landing(srv: ClusterServer, name: str, not_epoch: int | None = None) -> dict | None:
    """The decode worker's state once a stream lands there (one not under `not_epoch`), else None."""
    state = on(srv, name, _decode_state)
    return state if any(epoch != not_epoch for _, epoch, _ in state["landing"]) else None


def held_stream(srv: ClusterServer, names: list[str]) -> tuple[str, str]:
    """(worker, request id) of the one stream held at a prefill worker's gate."""
    def probe():
        held = [(n, rid) for n in names for rid in on(srv, n, _held)]
        assert len(held) <= 1, held
        return held[0] if held else None
    return until(probe, "a stream held after its first blocks")


@pytest.mark.parametrize("transport", ["zmq", "ray"])
def test_prefill_killed_mid_stream_frees_the_reservation_then_reruns_or_fails_cleanly(ray_local, local_engine,
                                                                                     transport):
    want = cc.greedy_ids(local_engine, PROMPT, max_tokens=8, ignore_eos=True)
    # the dead stay dead (max_restarts=0): part 2 has no prefill worker left
    srv = ClusterServer(ClusterConfig(prefill=2, decode=1, num_blocks=128, heartbeat_timeout_s=3.0,
                                      max_restarts=0, engine=STEP, transport=transport))
    try:
        port = srv.start()
        prefills = ["prefill-0", "prefill-1"]
        for name in prefills:
            on(srv, name, _hold)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(cc.complete, port, {"prompt": PROMPT, **GREEDY})
            victim, rid = held_stream(srv, prefills)
            other = next(n for n in prefills if n != victim)
            tid = f"{rid}/0"
            before = until(lambda: landing(srv, "decode-0"), "the offer landing")
            [(_, epoch, _)] = before["landing"]
            assert before["landing"] == [(tid, epoch, 13)] and before["used"] == 13 and before["adopted"] == 0
            assert before["credits"][rid][0] == epoch
            kill(srv, victim)

            # the rerun's stream is held too: by then the broken one was refused and its blocks are back
            until(lambda: on(srv, "decode-0", _decode_state)["errors"] == before["errors"] + 1,
                  "the decode worker to abort the broken stream")
            assert held_stream(srv, [other]) == (other, rid)
            now = until(lambda: landing(srv, "decode-0", not_epoch=epoch), "the rerun's offer landing")
            [(_, epoch2, _)] = now["landing"]
            assert epoch2 > epoch and now["landing"] == [(tid, epoch2, 13)]  # nothing reused, nothing doubled
            assert now["used"] == 13 and now["adopted"] == 0 and now["credits"][rid][0] == epoch2
            on(srv, other, _release)
            got = fut.result(timeout=120)
        assert got["choices"][0]["token_ids"] == want
        assert got["pdserve"]["backend"]["prefill_worker"] == other
        _at_rest(srv, failed=0, dead=(victim,))

        # part 2: the last prefill worker dies mid-stream: 503, and the decode worker is as it was
        on(srv, other, _hold)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(cc.complete, port, {"prompt": PROMPT[::-1], **GREEDY})
            assert held_stream(srv, [other])[0] == other
            until(lambda: landing(srv, "decode-0"), "the offer landing")
            kill(srv, other)
            with pytest.raises(urllib.error.HTTPError) as e:
                fut.result(timeout=120)
        assert e.value.code == 503
        assert "stopped responding and no other is live" in json.loads(e.value.read())["error"]["message"]
        _at_rest(srv, failed=1, dead=(victim, other))
    finally:
        srv.stop()


@pytest.mark.parametrize("transport", ["zmq", "ray"])
def test_decode_killed_mid_stream_prefill_finishes_and_resends_to_another(ray_local, local_engine, transport):
    want = cc.greedy_ids(local_engine, PROMPT, max_tokens=8, ignore_eos=True)
    srv = ClusterServer(ClusterConfig(prefill=1, decode=2, num_blocks=128, heartbeat_timeout_s=3.0,
                                      max_restarts=0, engine=STEP, transport=transport))
    try:
        port = srv.start()
        on(srv, "prefill-0", _hold)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(cc.complete, port, {"prompt": PROMPT, **GREEDY})
            _, rid = held_stream(srv, ["prefill-0"])
            # the prompt finishes computing while its stream waits: the final state is queued behind the gate
            until(lambda: on(srv, "prefill-0", _finalized, rid), "the prefill to finish")
            decodes = ["decode-0", "decode-1"]
            victim, state = until(lambda: next(((n, s) for n in decodes if (s := landing(srv, n))), None),
                                  "the offer landing")
            other = next(n for n in decodes if n != victim)
            assert state["landing"] == [(f"{rid}/0", srv.backend.ledger.get(rid).epoch + 1, 13)]
            kill(srv, victim)  # and wait until it is gone: ray.kill returns at once
            on(srv, "prefill-0", _release)
            got = fut.result(timeout=120)
        assert got["choices"][0]["token_ids"] == want
        backend = got["pdserve"]["backend"]
        assert (backend["decode_worker"], backend["resent"], backend["migration"]["to"]) == (other, 1, other)
        ws = _at_rest(srv, failed=0, dead=(victim,))
        prefill = ws["prefill-0"]
        assert (prefill["prefills"], prefill["resends"], prefill["streamed_migrations"]) == (1, 1, 1)
    finally:
        srv.stop()


def test_prefill_frozen_mid_stream_its_rerun_lands_on_the_same_decode_worker(ray_local, local_engine):
    import ray

    want = cc.greedy_ids(local_engine, PROMPT, max_tokens=8, ignore_eos=True)
    srv = ClusterServer(ClusterConfig(prefill=2, decode=1, num_blocks=128, heartbeat_timeout_s=3.0,
                                      max_restarts=0, engine=STEP))
    try:
        port = srv.start()
        prefills = ["prefill-0", "prefill-1"]
        for name in prefills:
            on(srv, name, _hold)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(cc.complete, port, {"prompt": PROMPT, **GREEDY})
            victim, rid = held_stream(srv, prefills)
            other = next(n for n in prefills if n != victim)
            before = until(lambda: landing(srv, "decode-0"), "the offer landing")
            on(srv, other, _release)
            ray.get(srv.backend.workers[victim].handle.inject_fault.remote("hang"), timeout=30)
            got = fut.result(timeout=120)
        assert got["choices"][0]["token_ids"] == want
        assert got["pdserve"]["backend"]["prefill_worker"] == other
        ws = _at_rest(srv, failed=0, dead=(victim,))
        assert (ws[other]["streamed_migrations"], ws[other]["stream_fallbacks"]) == (1, 0)  # no refusal
        assert on(srv, "decode-0", _decode_state)["errors"] == before["errors"] + 1  # the frozen one ended
    finally:
        srv.stop()


def test_a_stream_that_failed_mid_prefill_is_not_restarted_the_request_migrates_whole():
    """The prefill handler driven by hand (the transfer thread replaced by a list of jobs)."""
    from engine.engine import EngineConfig, LLMEngine
    from engine.sampling import SamplingParams
    from prefill_worker.handler import PrefillHandler, PrefillWorkerConfig
    from prefill_worker.migration_threads import MigrationResult
    from protocol.messages import Migrated, Submit
    from transfer.errors import TransportClosed

    engine = LLMEngine(EngineConfig(model="tiny", role="prefill", num_blocks=64, scheduler=STEP["scheduler"]))
    handler = PrefillHandler(PrefillWorkerConfig("p", ""), engine)
    jobs, events = [], []
    handler.migration_threads.start = jobs.append
    try:
        handler.handle(Submit("r", PROMPT, SamplingParams(max_tokens=4), "d", "tcp://127.0.0.1:9", 2), events)

        def step() -> None:
            handler.on_step(engine.step(), events)
            handler.after_step(events)
        step()
        assert [j.feed is not None for j in jobs] == [True]  # offered after the first chunk
        handler.handle(MigrationResult(jobs[0], TransportClosed("cut"), 0.0), events)
        for _ in range(50):
            if "r" not in engine.requests:
                break
            step()
        assert [j.feed is not None for j in jobs] == [True, False]  # one stream, then one whole migration
        assert (handler.stats()["streamed_migrations"], handler.stream_fallbacks) == (1, 1)
        totals = {"payload_bytes": 1, "blocks": 13, "reused_blocks": 0, "sequences": 1}
        handler.handle(MigrationResult(jobs[1], None, 1.0, totals), events)
        assert [e.request_id for e in events if isinstance(e, Migrated)] == ["r"]
        assert engine.kv.usage()["used_blocks"] == 0  # pinned and held blocks all returned
    finally:
        handler.close()


def _at_rest(srv: ClusterServer, failed: int, dead: tuple[str, ...]) -> dict:
    """Nothing held, reserved, landing or adopted on any worker but the `dead`; the ledger agrees and
    counts `failed` failures. Returns the workers' stats."""
    def quiet(ws):
        live = [w for w in ws.values() if w["name"] not in dead]
        return all(w["used_blocks"] == 0 and w.get("reserved_blocks", 0) == 0 and
                   w.get("held_for_resend", 0) == 0 and w.get("migrations_in_flight", 0) == 0 for w in live)
    ws = cc.poll_workers(srv.port, quiet)
    assert quiet(ws), ws
    for name, w in ws.items():
        if name not in dead and w["role"] == "decode":
            state = on(srv, name, _decode_state)
            assert (state["landing"], state["credits"], state["used"], state["adopted"]) == ([], {}, 0, 0)
    ledger = cc.cluster_info(srv.port)["ledger"]
    assert (ledger["active_requests"], ledger["owned_blocks"], ledger["failed"]) == (0, 0, failed)
    assert {n: d for n, d in cc.ledger_differences(srv.backend.info()).items() if n not in dead} == {}
    return ws
