"""Failures of the disaggregated cluster on a local Ray, each test on its own short-lived cluster
with its own wedge or kill (no test depends on another's leftovers): a dead decode worker, a wedged
prefill worker, a decode worker killed mid-decode or wedged mid-transfer (its held blocks re-sent
over ZeroMQ and over Ray), and no decode worker left to take held blocks. Every request is answered
with the local engine's tokens or fails loudly, and nothing is left held or used.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("ray")

import cluster_client as cc  # noqa: E402

from coordinator.cluster import ClusterConfig  # noqa: E402
from deploy.launch import ClusterServer  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.timeout(300)

PROMPTS = [list(range(1, 6)), list(range(10, 26)), list(range(30, 63)), [7, 8, 9] * 17]


def test_dead_decode_worker_fails_its_stream_and_new_requests_get_503(ray_local):
    """Killing the only decode actor mid-decode: the stream ends with an error event (not a hang),
    later requests get 503 naming the missing role, and /health says unhealthy."""
    import ray

    srv = ClusterServer(ClusterConfig(prefill=1, decode=1, num_blocks=128, heartbeat_timeout_s=3.0,
                                      max_restarts=0))  # stays dead: the 503s below are the point
    try:
        port = srv.start()
        assert len(cc.complete(port, {"prompt": PROMPTS[0], "max_tokens": 3})["choices"][0]["token_ids"]) == 3
        body = {"prompt": PROMPTS[0], "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
        lines = cc.stream_killing(port, body, lambda: ray.kill(srv.backend.workers["decode-0"].handle,
                                                               no_restart=True))
        assert lines[-1] == "[DONE]"
        err = json.loads(lines[-2])
        assert "error" in err and "decode-0" in err["error"]["message"]
        with pytest.raises(urllib.error.HTTPError) as e:
            cc.complete(port, {"prompt": PROMPTS[0], "max_tokens": 3})
        assert e.value.code == 503
        assert "no live decode worker" in json.loads(e.value.read())["error"]["message"]
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10)
        assert e.value.code == 503
        assert srv.backend.ledger.summary()["active_requests"] == 0
    finally:
        srv.stop()


def test_wedged_prefill_worker_requests_rerun_on_another(ray_local, local_engine):
    """Fault injection: prefill-0's loop stops (no steps, no heartbeats). Requests routed to it are
    rerun on prefill-1 once its heartbeat is missed, with the same tokens as the local engine."""
    srv = ClusterServer(ClusterConfig(prefill=2, decode=1, num_blocks=128, routing="round_robin",
                                      heartbeat_timeout_s=3.0))
    try:
        port = srv.start()
        import ray

        ray.get(srv.backend.workers["prefill-0"].handle.inject_fault.remote("hang"), timeout=30)
        want = cc.reference(local_engine, PROMPTS[:2], SamplingParams(max_tokens=6, ignore_eos=True))
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(cc.complete, port, {"prompt": p, "max_tokens": 6, "temperature": 0,
                                                  "ignore_eos": True}) for p in PROMPTS[:2]]
            got = [f.result(timeout=120) for f in futs]
        assert [[c["token_ids"] for c in g["choices"]] for g in got] == want
        assert {g["pdserve"]["backend"]["prefill_worker"] for g in got} == {"prefill-1"}
        info = cc.wait_at_rest(port)
        assert info["ledger"]["active_requests"] == 0 and info["ledger"]["failed"] == 0
        alive = {w["name"]: w["alive"] for w in info["workers"]}
        assert alive == {"prefill-0": False, "prefill-1": True, "decode-0": True}
    finally:
        srv.stop()


def test_decode_worker_killed_mid_decode_stream_resumes_without_gaps(ray_local, local_engine):
    """Killing the decode actor serving a seeded sampled stream: the coordinator re-prefills prompt +
    tokens streamed so far and continues on the other decode worker; the client's stream equals
    the local engine's output exactly (no duplicated, no lost tokens)."""
    import ray

    srv = ClusterServer(ClusterConfig(prefill=1, decode=2, num_blocks=128, heartbeat_timeout_s=3.0))
    try:
        port = srv.start()
        params = {"max_tokens": 150, "temperature": 0.9, "top_k": 40, "seed": 99, "ignore_eos": True}
        want = cc.reference(local_engine, [PROMPTS[2]], SamplingParams(**params))[0][0]
        ids: list[int] = []
        final = None
        killed = None
        with cc.post(port, {"prompt": PROMPTS[2], "stream": True, **params}) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                ids += chunk["choices"][0]["token_ids"]
                final = chunk.get("pdserve", final)
                if killed is None and len(ids) >= 5:
                    owner = [e.owner for e in srv.backend.ledger.active()]
                    assert len(owner) == 1 and owner[0].startswith("decode-")
                    killed = owner[0]
                    ray.kill(srv.backend.workers[killed].handle, no_restart=True)
        assert ids == want
        assert final["backend"]["resumed"] == 1 and final["backend"]["decode_worker"] not in (None, killed)
        info = cc.wait_at_rest(port)
        assert info["ledger"]["active_requests"] == 0 and info["ledger"]["failed"] == 0
        assert all(w["used_blocks"] == 0 for w in info["workers"] if w["alive"])
    finally:
        srv.stop()


def test_decode_worker_wedged_during_transfer_request_moves_to_another(ray_local, local_engine):
    """Fault injection: decode-0 stops serving (mid-transfer for whatever is routed to it). The
    migration times out on the prefill side, the coordinator reruns the prefill for another
    decode worker; both a greedy and an n=2 sampled request finish with the local engine's tokens."""
    import ray

    srv = ClusterServer(ClusterConfig(prefill=1, decode=2, num_blocks=128, routing="round_robin",
                                      heartbeat_timeout_s=3.0))
    try:
        port = srv.start()
        ray.get(srv.backend.workers["decode-0"].handle.inject_fault.remote("hang"), timeout=30)
        greedy = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
        sampled = {"max_tokens": 8, "temperature": 0.8, "seed": 5, "n": 2, "ignore_eos": True}
        want = [cc.reference(local_engine, [PROMPTS[1]], SamplingParams(**greedy))[0],
                cc.reference(local_engine, [PROMPTS[3]], SamplingParams(**sampled))[0]]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(cc.complete, port, {"prompt": PROMPTS[1], **greedy}),
                    pool.submit(cc.complete, port, {"prompt": PROMPTS[3], **sampled})]
            got = [f.result(timeout=120) for f in futs]
        assert [[c["token_ids"] for c in sorted(g["choices"], key=lambda c: c["index"])] for g in got] == want
        backends = [g["pdserve"]["backend"] for g in got]
        assert {b["decode_worker"] for b in backends} == {"decode-1"}
        assert sum(b["resumed"] for b in backends) == 1
        info = cc.wait_at_rest(port)
        assert info["ledger"]["active_requests"] == 0 and info["ledger"]["failed"] == 0
    finally:
        srv.stop()


# ---- a decode worker wedged mid-transfer: the held blocks are re-sent, no second prefill -----------------
# A wedged decode worker must still look alive when the next request is routed to it, so that the
# migration (timeout 0.6 x heartbeat) fails first and the held blocks are re-sent: 6 s leaves room
# for a loaded machine.
RESEND = ClusterConfig(prefill=1, decode=2, num_blocks=128, routing="round_robin", heartbeat_timeout_s=6.0)


def test_decode_worker_wedged_mid_transfer_gets_the_held_blocks_resent(ray_local, local_engine):
    srv = ClusterServer(RESEND)
    try:
        srv.start()
        _check_resend(srv, local_engine)
    finally:
        srv.stop()


def _until_wedged(backend, names: list[str], stuck_s: float = 0.6) -> None:
    """Wait until the wedge took effect: these workers' heartbeats (from their own thread, every
    0.2 s) say their loop has been stuck in one iteration for `stuck_s`. The hang is a queued
    command; a request sent at once could be imported just before it."""
    end = time.monotonic() + 10
    while any(backend.workers[n].progress.get("busy_s", 0.0) < stuck_s for n in names):
        assert time.monotonic() < end, "the wedged workers' loops kept making progress"
        time.sleep(0.05)


def _check_resend(cluster: ClusterServer, local_engine: LLMEngine) -> None:
    """Wedge decode-0, send a request routed to it: the prefill worker's migration times out, it keeps
    the blocks, and the coordinator has them re-sent to decode-1 (no second prefill); afterwards
    nothing is held or used anywhere and the ledger is at rest."""
    import ray

    port, backend = cluster.port, cluster.backend
    prompt = [(j * 7) % 250 + 1 for j in range(40)]
    want = cc.greedy_ids(local_engine, prompt, max_tokens=8, ignore_eos=True)
    cc.set_router(cluster, "decode", "round_robin")  # a fresh cycle: the next request goes to decode-0
    idle = cc.poll_workers(port, lambda ws: all(w["active_requests"] == 0 for w in ws.values()))
    prefills = sum(w["prefills"] for w in idle.values() if w["role"] == "prefill")
    failed = cc.cluster_info(port)["ledger"]["failed"]
    ray.get(backend.workers["decode-0"].handle.inject_fault.remote("hang"), timeout=30)
    _until_wedged(backend, ["decode-0"])

    got = cc.complete(port, {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert got["choices"][0]["token_ids"] == want
    info = got["pdserve"]["backend"]
    assert info["resent"] == 1 and info["decode_worker"] == "decode-1"
    assert info["migration"]["to"] == "decode-1"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert 'pdserve_retries_total{phase="resend"} 1.0' in r.read().decode()

    def at_rest(ws):
        live = [w for w in ws.values() if w["name"] != "decode-0"]
        return all(w["used_blocks"] == 0 for w in live) and all(
            w["held_for_resend"] == 0 and w["migrations_in_flight"] == 0
            for w in live if w["role"] == "prefill")
    ws = cc.poll_workers(port, at_rest)
    assert sum(w["prefills"] for w in ws.values() if w["role"] == "prefill") == prefills + 1  # no re-prefill
    assert sum(w["resends"] for w in ws.values() if w["role"] == "prefill") == 1
    live = {n: w["used_blocks"] for n, w in ws.items() if n != "decode-0"}
    assert live == {n: 0 for n in live}
    assert all(w["held_for_resend"] == 0 and w["migrations_in_flight"] == 0
               for w in ws.values() if w["role"] == "prefill")
    ledger = cc.cluster_info(port)["ledger"]
    assert ledger["active_requests"] == 0 and ledger["owned_blocks"] == 0 and ledger["failed"] == failed
    assert cc.ledger_differences(backend.info()) == {}


def test_no_decode_worker_can_take_the_held_blocks_503_and_they_are_released(ray_local):
    """Both decode workers wedged: a request's migration fails, the re-send to the other fails too,
    and no other decode worker is left, so the client gets 503 and the prefill worker releases the
    blocks it held."""
    import ray

    srv = ClusterServer(RESEND)
    try:
        port = srv.start()
        for name in ("decode-0", "decode-1"):
            ray.get(srv.backend.workers[name].handle.inject_fault.remote("hang"), timeout=30)
        _until_wedged(srv.backend, ["decode-0", "decode-1"])
        with pytest.raises(urllib.error.HTTPError) as e:
            cc.complete(port, {"prompt": list(range(40, 90)), "max_tokens": 8, "temperature": 0})
        body = json.loads(e.value.read())
        assert e.value.code == 503, body
        msg = body["error"]["message"]
        assert "migration to decode-1 failed" in msg
        assert "no other decode worker could take the held KV" in msg

        def released(found):
            return all(w["used_blocks"] == 0 and w["held_for_resend"] == 0 and w["migrations_in_flight"] == 0
                       for w in found.values() if w["role"] == "prefill")
        ws = cc.poll_workers(port, released)
        prefill = [w for w in ws.values() if w["role"] == "prefill"]
        at_rest = [(w["used_blocks"], w["held_for_resend"], w["migrations_in_flight"]) for w in prefill]
        assert at_rest == [(0, 0, 0)]
        ledger = cc.cluster_info(port)["ledger"]
        assert ledger["active_requests"] == 0 and ledger["failed"] == 1
    finally:
        srv.stop()


def test_resend_over_the_ray_transport(ray_local, local_engine):
    """The same resend with KV moving as Ray calls (a wedged decode actor never answers kv_query)."""
    srv = ClusterServer(ClusterConfig(prefill=1, decode=2, transport="ray", num_blocks=64,
                                      heartbeat_timeout_s=3.0))
    try:
        srv.start()
        _check_resend(srv, local_engine)
    finally:
        srv.stop()
