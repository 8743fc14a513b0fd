"""Planted KV is refused (issue 16): a peer that reaches a decode worker's receiver without a
reservation from the coordinator can neither import KV nor learn what the worker caches, and
the cluster's answers stay the local engine's.

The reproduction: migrate 64 tokens of random KV under a request id nobody made (tokens
300..363), even claiming to be the real prefill worker; then send a real request whose prompt
starts with those tokens. Once per transport, each on its own short-lived 1 + 1 cluster.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("ray")

import cluster_client as cc  # noqa: E402
import torch  # noqa: E402

from coordinator.cluster import ClusterConfig  # noqa: E402
from deploy.launch import ClusterServer  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from kvcache.storage import KVLayout  # noqa: E402
from measure.pools import fill_random_sequence, make_manager  # noqa: E402
from transfer.errors import NotAdmitted, Unauthenticated  # noqa: E402
from transfer.transport import TransportConfig  # noqa: E402
from transfer.wire_messages import DecodeState  # noqa: E402

pytestmark = pytest.mark.timeout(300)

PLANTED = list(range(300, 364))  # 64 tokens: 4 full blocks of 16


@pytest.fixture(scope="module", params=["zmq", "ray"])
def cluster(request, ray_local):
    srv = ClusterServer(ClusterConfig(prefill=1, decode=1, transport=request.param, num_blocks=128))
    try:
        srv.start()
        yield request.param, srv
    finally:
        srv.stop()


def _decode_worker(port: int) -> dict:
    return next(w for w in cc.cluster_info(port)["workers"] if w["role"] == "decode")


def _pool_after_heartbeat(port: int) -> tuple[int, int, int]:
    time.sleep(0.6)  # a few heartbeats: the snapshot includes anything the attempt changed
    w = _decode_worker(port)
    return w["used_blocks"], w["cached_blocks"], w["free_blocks"]


def _attacker(transport: str, srv: ClusterServer, local_engine, secret: str | None = None):
    """A sender with the decode worker's exact layout (same model), calling itself prefill-0. By
    default an insider: it holds the cluster secret, so only the missing reservation stops it."""
    secret = srv.backend.keys.secret if secret is None else secret
    fp = local_engine.storage.layout.fingerprint()
    layout = KVLayout(fp["num_layers"], fp["num_kv_heads"], fp["head_dim"], 16, fp["dtype"], fp["model"])
    manager = make_manager(layout, 16)
    fill_random_sequence(manager, "evil", len(PLANTED), torch.Generator().manual_seed(7), PLANTED)
    dw = _decode_worker(srv.port)
    if transport == "zmq":
        from transfer.channels.zmq_channel import ZmqSender

        sender = ZmqSender(layout.fingerprint(), TransportConfig(address=dw["address"], peer_name="prefill-0",
                                                                 connect_timeout_s=10, transfer_timeout_s=10,
                                                                 secret=secret, receiver=dw["name"]))
    else:
        import ray

        from transfer.channels.ray_channel import RaySender

        actor = ray.get_actor(dw["name"], namespace=srv.backend.namespace)
        config = TransportConfig(peer_name="prefill-0", checksum_mode="manifest", secret=secret,
                                 receiver=dw["name"])
        sender = RaySender(layout.fingerprint(), actor, config)
    return manager, sender


def test_planted_kv_is_refused_and_answers_stay_correct(cluster, local_engine):
    transport, srv = cluster
    cc.wait_at_rest(srv.port)
    before = _pool_after_heartbeat(srv.port)
    manager, sender = _attacker(transport, srv, local_engine)
    try:
        sender.connect()  # the handshake itself is allowed: it reveals only the layout
        state = DecodeState(list(PLANTED), SamplingParams().to_dict(), 0)
        with pytest.raises(NotAdmitted):
            sender.migrate(manager, "evil", "evil-request/0", 1, state, dedupe=False)
        assert manager.allocator.num_used == 4  # the refusal released the export's lease
    finally:
        if hasattr(sender, "close"):
            sender.close()
    assert _pool_after_heartbeat(srv.port) == before  # not one block allocated, cached or freed

    prompt = PLANTED + [5, 6, 7, 8]
    want = cc.reference(local_engine, [prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    got = cc.complete(srv.port, {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
    assert [c["token_ids"] for c in got["choices"]] == want
    assert got["pdserve"]["backend"]["migration"]["reused"] == 0  # nothing planted to reuse
    info = cc.wait_at_rest(srv.port)
    assert info["ledger"]["active_requests"] == 0


def test_dedupe_query_from_unknown_sender_is_refused(cluster, local_engine):
    """The query names a request id no reservation holds: refused, and nothing is said about
    which prefixes the decode worker caches (a real request cached them just before)."""
    transport, srv = cluster
    prompt = list(range(20, 60))
    cc.complete(srv.port, {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    cc.wait_at_rest(srv.port)
    before = _pool_after_heartbeat(srv.port)
    assert before[1] > 0  # the decode worker now caches that prompt's full blocks
    _, sender = _attacker(transport, srv, local_engine)
    try:
        with pytest.raises(NotAdmitted):
            sender.query("someone-else/0", prompt)
    finally:
        if hasattr(sender, "close"):
            sender.close()
    assert _pool_after_heartbeat(srv.port) == before


def test_a_peer_without_the_cluster_secret_is_refused_at_the_handshake(cluster, local_engine):
    """No secret (or a wrong one): the handshake is refused before the receiver says anything about
    itself, so no query or manifest of that connection is ever served: over zmq the KV socket's
    CURVE handshake already fails (Unauthenticated), over Ray the signed hello is refused."""
    transport, srv = cluster
    before = _pool_after_heartbeat(srv.port)
    for secret in ("", "not-the-cluster-secret"):
        _, sender = _attacker(transport, srv, local_engine, secret)
        try:
            with pytest.raises(Unauthenticated if transport == "zmq" else NotAdmitted):
                sender.connect()
        finally:
            if hasattr(sender, "close"):
                sender.close()
    assert _pool_after_heartbeat(srv.port) == before


def test_a_forged_report_from_an_unauthenticated_socket_is_never_read(cluster):
    """The report socket is a CURVE server that admits only the cluster's key: a plain PUSH socket
    claiming to be decode-0 cannot even connect, so its forged stats never reach /v1/cluster."""
    import zmq

    from protocol.codec import encode
    from protocol.messages import WorkerReport

    _, srv = cluster
    forged = WorkerReport("decode-0", {"used_blocks": 999_999, "failed": "forged"}, {"ghost": 999_999}, [])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 2000)
    try:
        sock.connect(srv.backend._pull.address)
        for _ in range(3):
            try:
                sock.send(encode(forged))
            except zmq.Again:  # never connected: exactly what CURVE + ZAP should do
                break
        time.sleep(1.0)
        worker = _decode_worker(srv.port)
        assert worker["used_blocks"] != 999_999 and worker["alive"] and not worker.get("failed")
        assert "ghost" not in srv.backend.workers["decode-0"].holdings
    finally:
        sock.close(0)
        ctx.term()
