"""Workers that come back: SIGKILL of a worker's process during a load of concurrent requests ends
with every request answered with the local engine's tokens or failed cleanly (an error the client
saw, never a wrong answer), the worker replaced after its backoff (it joins after the same
handshake as at start, under the name "<slot>-r1"), the restart counted, the ledger at rest and no
worker holding used blocks. One short-lived 1 prefill + 1 decode (or 1 colocated) cluster per
killed role, so the load cannot simply move to a sibling.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
import urllib.error

import pytest

pytest.importorskip("ray")

import cluster_client as cc  # noqa: E402

from coordinator.cluster import ClusterConfig  # noqa: E402
from deploy.launch import ClusterServer  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[(i * 11 + j) % 250 + 1 for j in range(12 + 5 * i)] for i in range(6)]


def _answer(port: int, prompt: list[int]):
    """The token ids, or the HTTP status of a clean failure."""
    try:
        body = cc.complete(port, {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True})
    except urllib.error.HTTPError as e:
        return e.code
    return body["choices"][0]["token_ids"]


@pytest.mark.parametrize("role", ["decode", "prefill", "colocated"])
def test_sigkill_under_load_then_the_worker_is_replaced(ray_local, local_engine, role):
    want = cc.reference(local_engine, PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    config = ClusterConfig(prefill=1, decode=1, colocated=int(role == "colocated"), num_blocks=128,
                           heartbeat_timeout_s=3.0, restart_backoff_s=0.5)
    srv = ClusterServer(config)
    try:
        port = srv.start()
        victim = next(w for w in cc.cluster_info(port)["workers"] if w["role"] == role)
        assert victim["pid"] > 0 and victim["node_id"] and victim["device"] == "cpu"
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = [pool.submit(_answer, port, p) for p in PROMPTS]
            time.sleep(0.5)  # requests are in flight: prefilling, migrating, decoding
            os.kill(victim["pid"], signal.SIGKILL)
            got = [a.result(timeout=120) for a in answers]
        for answer, reference in zip(got, want):  # right, or a clean server-side failure
            assert answer == reference[0] or answer in (500, 503, 504), (answer, reference[0])

        replacement = f"{victim['name']}-r1"
        ok = cc.poll_workers(port, lambda ws: replacement in ws and ws[replacement]["alive"], 60)
        assert replacement in ok and victim["name"] not in ok
        assert ok[replacement]["pid"] != victim["pid"]
        assert _answer(port, PROMPTS[0]) == want[0][0]  # capacity is back
        restarts = f'pdserve_worker_restarts_total{{role="{role}"}} 1.0'
        assert restarts in cc.get(port, "/metrics").decode()
        info = cc.wait_at_rest(port)
        assert info["ledger"]["active_requests"] == 0 and info["ledger"]["owned_blocks"] == 0
        assert all(w["used_blocks"] == 0 for w in info["workers"])
        assert cc.ledger_differences(info) == {}
    finally:
        srv.stop()
