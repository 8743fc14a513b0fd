"""A prefill worker killed in the middle of a streamed migration over the Ray transport, on a local
Ray cluster whose 32-token step budget splits the prompt into prefill chunks. The prefill
workers' transfer threads are paused by the test gate (`Shipper.hold_streams`) right after a
stream's first blocks went out, so the kill hits a stream the decode worker holds open (all 13
blocks reserved). No connection close tells the decode worker that its sender died: the rerun's
offer (a newer epoch its reservation admits) supersedes the broken stream, which is aborted whole
(its blocks return, nothing is adopted), and the request completes on the other prefill worker
with the local engine's greedy tokens; afterwards nothing is held anywhere.
"""

from __future__ import annotations

import concurrent.futures
import sys
import time

import pytest

pytest.importorskip("ray")

import cluster_client as cc  # noqa: E402

from coordinator.cluster import ClusterConfig  # noqa: E402
from deploy.launch import ClusterServer  # noqa: E402

PROMPT = [(j * 13) % 240 + 5 for j in range(200)]  # 7 prefill chunks, 13 blocks of 16
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", autouse=True)
def _probes_by_value():
    """The probes below run inside the worker actors (__ray_call__), where this module is not importable."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


# ---- probes, run in a worker actor's process ------------------------------------------------------
def _hold(actor) -> None:
    actor.handler.shipper.hold_streams()


def _release(actor) -> None:
    actor.handler.shipper.release_streams()


def _held(actor) -> list[str]:
    return sorted(actor.handler.shipper.held_streams)


def _decode_state(actor) -> dict:
    """Streams in flight (transfer id -> blocks reserved), pool blocks in use, sequences adopted,
    receiver errors. Read off the loop thread: retried when a dict changed under the walk."""
    h = actor.handler
    while True:
        try:
            landing = {tid: len(blocks) for tid, blocks in h.receiver.in_flight().items()}
            break
        except RuntimeError:
            continue
    return {"landing": landing, "used": h.engine.kv.allocator.num_used, "adopted": len(h.engine.requests),
            "errors": h.stats()["transfer_errors"]}


# ---- the test's side ------------------------------------------------------------------------------
def _on(srv, name: str, probe, *args):
    import ray

    return ray.get(srv.backend.workers[name].handle.__ray_call__.remote(probe, *args), timeout=30)


def _until(probe, what: str, timeout_s: float = 60.0):
    end = time.monotonic() + timeout_s
    while True:
        got = probe()
        if got:
            return got
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def _kill(srv, name: str) -> None:
    import ray

    handle = srv.backend.workers[name].handle
    ray.kill(handle, no_restart=True)

    def gone() -> bool:
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return True
        return False
    _until(gone, f"{name} to die")


def test_ray_prefill_killed_mid_stream_frees_the_reservation_and_the_request_reruns(ray_local, local_engine):
    want = cc.greedy_ids(local_engine, PROMPT, max_tokens=8, ignore_eos=True)
    srv = ClusterServer(ClusterConfig(prefill=2, decode=1, transport="ray", num_blocks=128,
                                      heartbeat_timeout_s=3.0, max_restarts=0,
                                      engine={"scheduler": {"max_num_batched_tokens": 32}}))
    try:
        port = srv.start()
        prefills = ["prefill-0", "prefill-1"]
        for name in prefills:
            _on(srv, name, _hold)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(cc.complete, port, {"prompt": PROMPT, **GREEDY})
            victim, rid = _until(lambda: next(((n, r) for n in prefills for r in _on(srv, n, _held)), None),
                                 "a stream held after its first blocks")
            other = next(n for n in prefills if n != victim)
            tid = f"{rid}/0"
            before = _until(lambda: (s := _on(srv, "decode-0", _decode_state))["landing"] and s, "the offer")
            assert before["landing"] == {tid: 13} and before["used"] == 13 and before["adopted"] == 0
            _kill(srv, victim)
            # the rerun's offer (a newer epoch, admitted) supersedes the broken stream, which is aborted
            # (counted once); the rerun's stream, held at the other prefill worker's gate, holds the
            # only reservation: nothing of the dead one is left
            _until(lambda: _on(srv, other, _held) == [rid], "the rerun's stream held at the other prefill")
            assert _on(srv, "decode-0", _decode_state)["errors"] == before["errors"] + 1
            now = _until(lambda: (s := _on(srv, "decode-0", _decode_state))["landing"] and s,
                         "the rerun's offer")
            assert now["landing"] == {tid: 13} and now["used"] == 13 and now["adopted"] == 0
            _on(srv, other, _release)
            got = fut.result(timeout=120)
        assert got["choices"][0]["token_ids"] == want
        assert got["pdserve"]["backend"]["prefill_worker"] == other
        def quiet(ws):  # nothing held, reserved or in flight on a live worker
            return all(w["used_blocks"] == 0 and w.get("reserved_blocks", 0) == 0
                       and w.get("migrations_in_flight", 0) == 0 for n, w in ws.items() if n != victim)
        assert quiet(cc.poll_workers(port, quiet))
        assert _on(srv, "decode-0", _decode_state)["landing"] == {}
        ledger = cc.cluster_info(port)["ledger"]
        assert (ledger["active_requests"], ledger["owned_blocks"]) == (0, 0)
    finally:
        srv.stop()
