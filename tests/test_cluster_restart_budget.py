"""A restart budget that cannot end in a permanent outage (issue 28): past `max_restarts` quick
replacements a slot is still retried, every `restart_max_backoff_s`, and /health and /v1/cluster
say why it is empty meanwhile. Before, the second death of the slot below left the cluster
without a decode worker for good ("died N times ... not replaced", /health 503 until a restart).
Also: a command the coordinator cannot encode is the request's error, never a worker's death.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request

import pytest

pytest.importorskip("ray")

import cluster_client as cc  # noqa: E402

from coordinator.cluster import ClusterConfig  # noqa: E402
from coordinator.workers import CommandEncodeError, actor_died, encode_command  # noqa: E402
from deploy.launch import ClusterServer  # noqa: E402
from protocol.messages import Abort  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_an_unencodable_command_is_the_requests_error_not_a_death():
    for cmd in (Abort("r\ud800"), Abort(object())):  # a lone surrogate; a value msgpack cannot take
        with pytest.raises(CommandEncodeError):
            encode_command(cmd)
    assert not actor_died(RuntimeError("the worker raised")) and not actor_died(TimeoutError())


def _health(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_a_slot_past_its_quick_restarts_is_still_refilled(ray_local):
    config = ClusterConfig(prefill=1, decode=1, num_blocks=64, heartbeat_timeout_s=2.0, max_restarts=1,
                           restart_backoff_s=0.2, restart_max_backoff_s=3.0)
    srv = ClusterServer(config)
    try:
        port = srv.start()
        for generation in (1, 2):  # the second death is past the budget of one quick restart
            victim = next(w for w in cc.cluster_info(port)["workers"] if w["role"] == "decode")
            os.kill(victim["pid"], signal.SIGKILL)
            replacement = f"decode-0-r{generation}"
            if generation == 2:  # while it waits its slower turn, the slot says why it is empty
                cc.poll_workers(port, lambda ws: cc.cluster_info(port)["empty_slots"], 30)
                empty = cc.cluster_info(port)["empty_slots"]
                assert "decode-0" in empty and "replacement try 2" in empty["decode-0"], empty
                status, body = _health(port)
                assert status == 503 and "decode-0" in json.loads(body)["message"], body
            ok = cc.poll_workers(port, lambda ws, r=replacement: r in ws and ws[r]["alive"], 60)
            assert replacement in ok and ok[replacement]["pid"] != victim["pid"]
        assert _health(port)[0] == 200 and not cc.cluster_info(port)["empty_slots"]
        body = cc.complete(port, {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True})
        assert len(body["choices"][0]["token_ids"]) == 4
    finally:
        srv.stop()
