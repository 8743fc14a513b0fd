"""More end-to-end checks of the disaggregated cluster on a local Ray: the real `openai` client, the
`pdserve generate --url` CLI, refusal of an incompatible prefill/decode pair at start, routing
policies across two prefill workers, and a decode worker wedged mid-transfer (the prefill worker
re-sends the blocks it still holds to another decode worker, no re-prefill).

One Ray and one cluster for the module (2 prefill + 2 decode workers, prefix-aware routing, blocks
of 16), always torn down. The wedged-decode test runs LAST on it: it leaves decode-0 wedged.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("ray")
openai = pytest.importorskip("openai")

import cluster_client as cc  # noqa: E402

from coordinator.cluster import ClusterBackend, ClusterConfig  # noqa: E402
from coordinator.router import Router  # noqa: E402
from deploy.launch import ClusterServer  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.timeout(300)

# A wedged decode worker must still look alive when the next request is routed to it, so that the
# migration (timeout 0.6 x heartbeat) fails first and the held blocks are re-sent: 6 s leaves room
# for a loaded machine.
CONFIG = ClusterConfig(prefill=2, decode=2, num_blocks=128, routing="prefix_aware", heartbeat_timeout_s=6.0)


@pytest.fixture(scope="module")
def cluster(ray_local):
    srv = ClusterServer(CONFIG)
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


def _workers(port: int) -> dict[str, dict]:
    return {w["name"]: w for w in cc.cluster_info(port)["workers"]}


def _poll(port: int, ok, deadline_s: float = 20.0) -> dict[str, dict]:
    """Worker stats (from their heartbeats, ~0.2 s apart) once `ok(workers)` holds; the last ones
    if it never does within the deadline (the caller's asserts then fail with them)."""
    end = time.monotonic() + deadline_s
    while True:
        ws = _workers(port)
        if ok(ws) or time.monotonic() > end:
            return ws
        time.sleep(0.2)


def _set_router(srv: ClusterServer, role: str, policy: str) -> None:
    async def set_it():
        srv.backend.routers[role] = Router(policy)
    srv.call(set_it())


def _ids(engine: LLMEngine, prompt, **params) -> list[int]:
    ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    return engine.generate([ids], SamplingParams(**params))[0].choices[0]["token_ids"]


# ---- 1. the real openai client ---------------------------------------------------------------------
def test_openai_client_completions_stream_models_and_errors(cluster, local_engine):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.port}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    prompt = "The quick brown fox jumps over"
    want = _ids(local_engine, prompt, max_tokens=12, ignore_eos=True)
    kw = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
          "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**kw)
    assert len(whole.choices) == 1
    assert whole.choices[0].model_extra["token_ids"] == want
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens == len(
        local_engine.tokenizer.encode(prompt))
    text, ids = "", []
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            text += c.text or ""
            ids += (c.model_extra or {}).get("token_ids") or []
    assert text == whole.choices[0].text and ids == want
    assert [m.id for m in client.models.list()] == ["tiny"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=[5, 6, 99999], max_tokens=4)
    assert e.value.status_code == 400 and "99999" in str(e.value)


# ---- 2. pdserve generate --url == --local --------------------------------------------------------------
def test_cli_generate_url_prints_the_same_json_as_local(cluster, capsys):
    from pdserve_cli.main import main

    args = ["generate", "Once upon a time", "--json", "--max-tokens", "10"]
    assert main([*args, "--url", f"http://127.0.0.1:{cluster.port}"]) == 0
    remote = json.loads(capsys.readouterr().out)
    assert main([*args, "--local"]) == 0
    local = json.loads(capsys.readouterr().out)
    assert remote["choices"] == local["choices"]
    assert remote["usage"] == local["usage"]
    assert len(local["choices"][0]["token_ids"]) >= 1


# ---- 3. incompatible pair refused at start ---------------------------------------------------------
def test_another_model_of_the_same_shape_is_refused_at_start(ray_local, tmp_path):
    """Equal KV layouts, different weights: the fingerprint's model identity refuses the pair."""
    from bench.engine import write_random_llama

    prefill_ckpt = write_random_llama(str(tmp_path / "a"), seed=0)
    decode_ckpt = write_random_llama(str(tmp_path / "b"), seed=1)
    backend = ClusterBackend(ClusterConfig(prefill=1, decode=1, num_blocks=32, model=prefill_ckpt,
                                           decode_model=decode_ckpt))
    with pytest.raises(RuntimeError) as e:
        asyncio.run(backend.start())
    msg = str(e.value)
    assert "cannot hand KV" in msg and "model: sender" in msg and "num_layers" not in msg
    assert backend.workers == {}



def test_incompatible_decode_model_is_refused_at_start(ray_local, tmp_path):
    import ray

    from bench.engine import write_random_llama

    ckpt = write_random_llama(str(tmp_path / "two-layers"), layers=2)  # tiny has 4 layers
    backend = ClusterBackend(ClusterConfig(prefill=1, decode=1, num_blocks=32, decode_model=ckpt))
    with pytest.raises(RuntimeError) as e:
        asyncio.run(backend.start())
    msg = str(e.value)
    assert "prefill-0" in msg and "decode-0" in msg and "cannot hand KV" in msg
    assert "num_layers: sender 4 vs receiver 2" in msg and ckpt in msg
    assert backend.workers == {}
    end = time.monotonic() + 20
    while True:  # ray.kill is asynchronous: the names go once the actors are dead
        left = [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"] == backend.namespace]
        if not left or time.monotonic() > end:
            break
        time.sleep(0.2)
    assert left == []


# ---- 4. routing policies across two prefill workers ---------------------------------------------------
def test_prefix_aware_routing_reuses_the_prefix_cache_and_round_robin_alternates(cluster):
    port = cluster.port
    prefix = [(j * 11) % 250 + 1 for j in range(80)]  # 5 full blocks of 16
    bodies = [{"prompt": prefix + tail, "max_tokens": 2, "temperature": 0}
              for tail in ([3, 4, 5], [9, 8, 7, 6])]
    first = cc.complete(port, bodies[0])["pdserve"]["backend"]["prefill_worker"]
    before = _poll(port, lambda ws: ws[first]["active_requests"] == 0)[first]
    second = cc.complete(port, bodies[1])["pdserve"]["backend"]["prefill_worker"]
    assert second == first
    after = _poll(port, lambda ws: ws[first]["prefills"] > before["prefills"])[first]
    assert after["prefills"] == before["prefills"] + 1
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] >= 80  # all 5 shared blocks hit

    _set_router(cluster, "prefill", "round_robin")
    try:
        other = [(j * 17) % 250 + 1 for j in range(80)]
        got = [cc.complete(port, {"prompt": other + [t], "max_tokens": 2, "temperature": 0})
               ["pdserve"]["backend"]["prefill_worker"] for t in (1, 2, 3, 4)]
    finally:
        _set_router(cluster, "prefill", CONFIG.routing)
    assert got[0] != got[1] and got[0::2] == [got[0]] * 2 and got[1::2] == [got[1]] * 2


# ---- 5. decode worker wedged mid-transfer: held blocks re-sent (keep this test LAST) ------------------
def test_decode_worker_wedged_mid_transfer_gets_the_held_blocks_resent(cluster, local_engine):
    _check_resend(cluster, local_engine)


def _check_resend(cluster: ClusterServer, local_engine: LLMEngine) -> None:
    """Wedge decode-0, send a request routed to it: the prefill worker's migration times out, it keeps
    the blocks, and the coordinator has them re-sent to decode-1 (no second prefill); afterwards
    nothing is held or used anywhere and the ledger is at rest."""
    import ray

    port, backend = cluster.port, cluster.backend
    prompt = [(j * 7) % 250 + 1 for j in range(40)]
    want = _ids(local_engine, prompt, max_tokens=8, ignore_eos=True)
    _set_router(cluster, "decode", "round_robin")  # a fresh cycle: the next request goes to decode-0
    idle = _poll(port, lambda ws: all(w["active_requests"] == 0 for w in ws.values()))
    prefills = sum(w["prefills"] for w in idle.values() if w["role"] == "prefill")
    failed = cc.cluster_info(port)["ledger"]["failed"]
    ray.get(backend.workers["decode-0"].handle.inject_fault.remote("hang"), timeout=30)

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
            w["held_for_resend"] == 0 and w["leases"] == 0 for w in live if w["role"] == "prefill")
    ws = _poll(port, at_rest)
    assert sum(w["prefills"] for w in ws.values() if w["role"] == "prefill") == prefills + 1  # no re-prefill
    assert sum(w["resends"] for w in ws.values() if w["role"] == "prefill") == 1
    live = {n: w["used_blocks"] for n, w in ws.items() if n != "decode-0"}
    assert live == {n: 0 for n in live}
    assert all(w["held_for_resend"] == 0 and w["leases"] == 0 for w in ws.values() if w["role"] == "prefill")
    ledger = cc.cluster_info(port)["ledger"]
    assert ledger["active_requests"] == 0 and ledger["owned_blocks"] == 0 and ledger["failed"] == failed
    assert backend.ledger.reconcile(live) == {}


def test_no_decode_worker_can_take_the_held_blocks_503_and_they_are_released(cluster):
    """Runs after the test above (decode-0 already wedged): wedging decode-1 too, a request's migration
    fails and no other decode worker is live, so the client gets 503 at once and the prefill worker
    releases the blocks it held."""
    import ray

    port, backend = cluster.port, cluster.backend
    failed = cc.cluster_info(port)["ledger"]["failed"]
    ray.get(backend.workers["decode-1"].handle.inject_fault.remote("hang"), timeout=30)
    with pytest.raises(urllib.error.HTTPError) as e:
        cc.complete(port, {"prompt": list(range(40, 90)), "max_tokens": 8, "temperature": 0})
    body = json.loads(e.value.read())
    assert e.value.code == 503, body
    msg = body["error"]["message"]
    assert "migration to decode-1 failed" in msg and "no other decode worker could take the held KV" in msg
    ws = _poll(port, lambda ws: all(w["used_blocks"] == 0 and w["held_for_resend"] == 0 and w["leases"] == 0
                                    for w in ws.values() if w["role"] == "prefill"))
    prefill = [w for w in ws.values() if w["role"] == "prefill"]
    assert [(w["used_blocks"], w["held_for_resend"], w["leases"]) for w in prefill] == [(0, 0, 0)] * 2
    ledger = cc.cluster_info(port)["ledger"]
    assert ledger["active_requests"] == 0 and ledger["failed"] == failed + 1


# ---- the prefill worker's hold, in-process (no Ray): expiry and abort release the blocks ---------------
def test_prefill_worker_releases_held_blocks_on_abort_and_on_hold_expiry():
    import msgpack
    import zmq

    from prefill_worker.worker import PrefillWorker

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    addr = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    w = PrefillWorker({"name": "p", "events_address": addr, "engine": {"model": "tiny", "num_blocks": 32},
                       "transfer_timeout_s": 1.0, "hold_s": 4.0})
    stats: dict = {}

    def until(pred, deadline_s: float = 30.0) -> list[dict]:
        seen, end = [], time.monotonic() + deadline_s
        while time.monotonic() < end:
            if pull.poll(200):
                msg = msgpack.unpackb(pull.recv(), raw=False)
                stats.update(msg["stats"])
                seen += msg["events"]
                if pred(seen):
                    return seen
        raise AssertionError(f"condition not reached; events {seen}, stats {stats}")

    try:
        params = SamplingParams(max_tokens=4).to_dict()
        nowhere = "tcp://127.0.0.1:9"  # nothing listens: the handshake times out
        for rid in ("a", "b"):
            assert w.submit(rid, list(range(1, 40)), params, "decode-x", nowhere, 2) is None
        until(lambda evs: {e["rid"] for e in evs if e["k"] == "err" and e.get("held")} == {"a", "b"})
        until(lambda evs: stats["held_for_resend"] == 2)
        assert stats["used_blocks"] > 0 and stats["leases"] == 0
        w.abort("b")
        until(lambda evs: stats["held_for_resend"] == 1)
        assert w.resend("b", "decode-x", nowhere, 4) == "request b is not held on p"
        evs = until(lambda evs: any(e["k"] == "err" and e["kind"] == "hold_expired" for e in evs))
        assert [e["rid"] for e in evs if e["k"] == "err"] == ["a"]
        until(lambda evs: stats["held_for_resend"] == 0)
        assert stats["used_blocks"] == 0 and stats["hold_expired"] == 1 and stats["prefills"] == 2
        w.engine.kv.check_integrity()
    finally:
        w.shutdown()
        pull.close(0)
        ctx.term()


def test_resend_over_the_ray_transport(ray_local, local_engine):
    """The same resend with KV moving as Ray calls (a wedged decode actor never answers kv_query)."""
    srv = ClusterServer(ClusterConfig(prefill=1, decode=2, transport="ray", num_blocks=64,
                                      heartbeat_timeout_s=3.0))
    try:
        srv.start()
        _check_resend(srv, local_engine)
    finally:
        srv.stop()
