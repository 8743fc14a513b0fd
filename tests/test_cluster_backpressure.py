"""Credit-based backpressure end to end on a local Ray: decode workers whose pools hold only two
requests each receive more concurrent requests than fit. Each migration is reserved first
(the `Reserve` command); refused ones try the other decode worker, then wait. Every request
completes with the in-process engine's tokens, refusals are counted, and afterwards no block is
used and no credit is left reserved anywhere, with the ledger at rest.

One short-lived cluster: 1 prefill worker (128 blocks) + 2 decode workers of 8 blocks of 16
tokens. A request of 40 prompt tokens reserves ceil(41/16) + 1 = 4 blocks and grows to
ceil(60/16) = 4 blocks over 20 output tokens, so at most two run per decode worker.
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
from engine.engine import EngineConfig, LLMEngine  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from protocol.codec import decode, encode  # noqa: E402
from protocol.messages import Abort, Reserve  # noqa: E402

pytestmark = pytest.mark.timeout(300)

CONFIG = ClusterConfig(prefill=1, decode=2, num_blocks=128, decode_num_blocks=8, block_size=16,
                       routing="round_robin")


@pytest.fixture(scope="module")
def cluster(ray_local):
    srv = ClusterServer(CONFIG)
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


def test_overload_waits_for_room_and_every_request_completes(cluster):
    prompts = [[(i * 17 + j * 3) % 250 + 1 for j in range(40)] for i in range(10)]
    engine = LLMEngine(EngineConfig(model="tiny"))
    want = [[c["token_ids"] for c in comp.choices]
            for comp in engine.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))]
    body = {"max_tokens": 20, "temperature": 0, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futs = [pool.submit(cc.complete, cluster.port, {"prompt": p, **body}) for p in prompts]
        got = [f.result(timeout=180) for f in futs]
    assert [[c["token_ids"] for c in g["choices"]] for g in got] == want
    assert {g["pdserve"]["backend"]["decode_worker"] for g in got} == {"decode-0", "decode-1"}

    text = cc.get(cluster.port, "/metrics").decode()
    refusals = [float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("pdserve_backpressure_refusals_total{")]
    assert refusals and sum(refusals) > 0  # some requests found both decode pools full and waited
    info = cc.wait_at_rest(cluster.port)
    decode = [w for w in info["workers"] if w["role"] == "decode"]
    assert sum(w["refused_reservations"] for w in decode) == sum(refusals)
    assert all(w["total_blocks"] == 8 and w["preemptions"] == 0 for w in decode)  # never overflowed
    assert all(w["used_blocks"] == 0 and w["reserved_blocks"] == 0 for w in decode)
    assert all(w["used_blocks"] == 0 for w in info["workers"])
    assert info["ledger"]["active_requests"] == 0 and info["ledger"]["failed"] == 0
    assert cc.ledger_differences(info) == {} and cc.discrepancies(cluster.port) == 0


def test_request_larger_than_every_decode_pool_is_refused_with_400(cluster):
    """200 prompt tokens need ceil(201/16) + 1 = 14 blocks on import: no 8-block pool ever fits."""
    with pytest.raises(urllib.error.HTTPError) as e:
        cc.complete(cluster.port, {"prompt": [5] * 200, "max_tokens": 4, "temperature": 0})
    assert e.value.code == 400
    assert "exceed every decode worker's KV pool" in json.loads(e.value.read())["error"]["message"]
    info = cc.wait_at_rest(cluster.port)
    assert info["ledger"]["active_requests"] == 0
    assert all(w["used_blocks"] == 0 and w.get("reserved_blocks", 0) == 0 for w in info["workers"])


def _command(handle, cmd):
    import ray

    return decode(ray.get(handle.command.remote(encode(cmd)), timeout=30))


def test_reserve_admits_by_free_blocks_and_releases_on_abort(cluster):
    """The typed command directly: 8 free blocks admit 4 + 4, refuse a third, and abort frees the
    credit so the same request fits again; a malformed Reserve is refused with a typed error."""
    import ray

    h = cluster.backend.workers["decode-1"].handle
    deadline = time.monotonic() + 20  # the earlier tests' sequences and credit gone from this pool
    while True:
        stats = ray.get(h.stats.remote(), timeout=30)
        idle = stats["free_blocks"] + stats["cached_blocks"] == 8 and stats["reserved_blocks"] == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert idle, stats
    assert _command(h, Reserve("bp-a", 1, 41, 1)).granted is True
    assert _command(h, Reserve("bp-b", 1, 41, 1)).granted is True, ray.get(h.stats.remote(), timeout=30)
    assert _command(h, Reserve("bp-c", 1, 41, 1)).granted is False
    assert _command(h, Reserve("bp-d", 1, 10, 2)).granted is False  # 2 x (1 + 1) blocks
    _command(h, Abort("bp-a"))
    assert _command(h, Reserve("bp-c", 1, 10, 2)).granted is True   # 4 blocks freed by abort
    for rid in ("bp-b", "bp-c"):
        _command(h, Abort(rid))
    deadline = time.monotonic() + 10
    while ray.get(h.stats.remote(), timeout=30)["reserved_blocks"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.get(h.stats.remote(), timeout=30)["reserved_blocks"] == 0
    bad = encode(Reserve("bp-e", 1, 1, 1)).replace(b"num_tokens\x01", b"num_tokens\x00")
    assert "num_tokens >= 1" in decode(ray.get(h.command.remote(bad), timeout=30)).error
    assert "bad command" in decode(ray.get(h.command.remote(b"\xc1garbage"), timeout=30)).error


def test_unconsumed_credit_expires_after_its_ttl():
    """A reservation whose migration never comes (a prefill that was lost) is released after
    reserve_ttl_s, so credits never leak. The worker body runs in-process here (no actor)."""
    from worker_harness import in_process

    from decode_worker.worker import DecodeWorker

    with in_process(DecodeWorker, {"name": "decode-ttl", "engine": {"num_blocks": 8},
                                   "reserve_ttl_s": 2.0}) as (w, _):
        _ttl_checks(w)


def _reserve_in_process(w, rid: str, epoch: int, tokens: int, n: int, sender: str = "") -> bool:
    return decode(w.command(encode(Reserve(rid, epoch, tokens, n, sender)))).granted


def _ttl_checks(w) -> None:
    def wait_reserved(n: int) -> int:  # the loop's stats snapshot, polled (bounded)
        deadline = time.monotonic() + 10
        while w.stats()["reserved_blocks"] != n and time.monotonic() < deadline:
            time.sleep(0.02)
        return w.stats()["reserved_blocks"]

    def reserve(rid, epoch, tokens, n, sender=""):
        return _reserve_in_process(w, rid, epoch, tokens, n, sender)

    assert reserve("a", 1, 41, 1) and reserve("b", 1, 41, 1)
    assert not reserve("c", 1, 41, 1)
    assert w.handler.credits.refused == 1  # (the stats snapshot shows it one iteration later)
    assert wait_reserved(8) == 8
    assert wait_reserved(0) == 0  # expired: nothing was imported for them
    assert reserve("c", 1, 41, 1)


def test_reservation_is_the_receivers_admission():
    """Only a live reservation's (request, epoch, sender) may send KV or ask what is cached; a
    sequence index beyond its n, an abort or an expired credit closes it (in-process worker)."""
    from worker_harness import in_process

    from decode_worker.worker import DecodeWorker

    with in_process(DecodeWorker, {"name": "decode-adm", "engine": {"num_blocks": 32},
                                   "reserve_ttl_s": 1.0}) as (w, _):
        _admission_checks(w)


def _admission_checks(w) -> None:
    credits = w.handler.credits

    def reserve(rid, epoch, tokens, n, sender=""):
        return _reserve_in_process(w, rid, epoch, tokens, n, sender)

    assert not credits.admit_transfer("r/0", 3, "prefill-0")
    assert not credits.admit_query("r/0", "prefill-0")
    assert reserve("r", 3, 20, 2, "prefill-0")
    assert credits.admit_transfer("r/0", 3, "prefill-0") and credits.admit_transfer("r/1", 3, "prefill-0")
    assert credits.admit_query("r/1", "prefill-0")
    assert not credits.admit_transfer("r/2", 3, "prefill-0")      # only n = 2 sequences
    assert not credits.admit_transfer("r/0", 2, "prefill-0")      # another epoch
    assert not credits.admit_transfer("r/0", 3, "prefill-1")      # another sender
    assert not credits.admit_query("r/0", "prefill-1") and not credits.admit_query("q/0", "prefill-0")
    assert not credits.admit_transfer("r", 3, "prefill-0")        # not a transfer id
    w.command(encode(Abort("r")))
    assert not credits.admit_transfer("r/0", 3, "prefill-0")
    assert reserve("s", 1, 20, 1, "prefill-0")
    time.sleep(1.2)
    assert not credits.admit_transfer("s/0", 1, "prefill-0")      # expired credit


def test_beyond_max_waiting_requests_get_429_at_once_and_the_rest_complete(cluster):
    """With room for 4 requests (2 per decode worker) and one place in line, a burst of 10 gets
    answers for those that fit or waited, and 429 + Retry-After for the rest, never a long wait."""
    import dataclasses

    config = cluster.backend.config

    async def set_config(value):
        cluster.backend.state.config = value
    cluster.call(set_config(dataclasses.replace(config, max_waiting=1)))
    try:
        prompts = [[(i * 19 + j * 5) % 250 + 1 for j in range(40)] for i in range(10)]
        body = {"max_tokens": 20, "temperature": 0, "ignore_eos": True}

        def attempt(prompt):
            try:
                with cc.post(cluster.port, {"prompt": prompt, **body}) as r:
                    return r.status, None
            except urllib.error.HTTPError as e:
                return e.code, e.headers.get("Retry-After")

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(attempt, prompts))
    finally:
        cluster.call(set_config(config))
    statuses = sorted(status for status, _ in results)
    assert statuses.count(200) >= 4 and statuses.count(429) >= 1 and set(statuses) <= {200, 429}
    assert all(retry == "1" for status, retry in results if status == 429)
    info = cc.wait_at_rest(cluster.port)
    assert all(w["used_blocks"] == 0 and w.get("reserved_blocks", 0) == 0 for w in info["workers"])
