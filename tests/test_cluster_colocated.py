"""End to end on a local Ray: `ClusterConfig(colocated=K)` (what `pdserve up --colocated K` runs), K
engines that each do both phases behind the same coordinator, API, ledger and metrics, gives the
in-process engine's tokens; its requests never migrate, the ledger comes to rest with no block
used anywhere, and a colocated worker that dies fails its stream fast with a clear error.

One Ray for the module; one cluster per K in (1, 2) (module scoped, round robin, always torn
down), plus a short-lived one-worker cluster for the failure test.
"""

from __future__ import annotations

import concurrent.futures
import json
import urllib.error
import urllib.request

import pytest

pytest.importorskip("ray")

import cluster_client as cc  # noqa: E402

from coordinator.cluster import ClusterConfig  # noqa: E402
from deploy.launch import ClusterServer  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.timeout(300)

PROMPTS = [list(range(1, 6)), list(range(10, 26)), list(range(30, 63)), [7, 8, 9] * 17]


@pytest.fixture(scope="module", params=[1, 2], ids=lambda k: f"colocated{k}")
def cluster(request, ray_local):
    srv = ClusterServer(ClusterConfig(colocated=request.param, num_blocks=256, routing="round_robin"))
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


def test_greedy_tokens_equal_local_engine_and_nothing_migrates(cluster, local_engine):
    want = cc.reference(local_engine, PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    workers = set()
    for prompt, ref in zip(PROMPTS, want):
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        got = cc.complete(cluster.port, body)
        assert [c["token_ids"] for c in got["choices"]] == ref
        backend = got["pdserve"]["backend"]
        assert "migration" not in backend and backend["role"] == "colocated"
        workers.add(backend["worker"])
    k = cluster.backend.config.colocated
    assert workers == {f"colocated-{i}" for i in range(k)}  # round robin used every worker


def test_sampled_n2_equals_local_engine(cluster, local_engine):
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=50, seed=1234, n=2, ignore_eos=True)
    want = cc.reference(local_engine, [PROMPTS[2]], params)[0]
    got = cc.complete(cluster.port, {"prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0.9, "top_k": 50,
                                   "seed": 1234, "n": 2, "ignore_eos": True})
    assert [c["token_ids"] for c in sorted(got["choices"], key=lambda c: c["index"])] == want


def test_streaming_equals_non_streaming(cluster):
    body = {"prompt": PROMPTS[3], "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    whole = cc.complete(cluster.port, body)
    assert cc.stream(cluster.port, body) == {c["index"]: c["token_ids"] for c in whole["choices"]}


def test_concurrent_requests_complete_and_ledger_is_at_rest(cluster, local_engine):
    prompts = [[(i * 11 + j) % 250 + 1 for j in range(6 + 4 * i)] for i in range(8)]
    want = cc.reference(local_engine, prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(cc.complete, cluster.port, {"prompt": p, "max_tokens": 10, "temperature": 0,
                                                      "ignore_eos": True}) for p in prompts]
        got = [[c["token_ids"] for c in f.result(timeout=120)["choices"]] for f in futs]
    assert got == want
    info = cc.wait_at_rest(cluster.port)
    assert info["mode"] == "colocated"
    assert info["ledger"]["active_requests"] == 0 and info["ledger"]["owned_blocks"] == 0
    assert info["ledger"]["failed"] == 0 and info["ledger"]["finished"] >= 8
    used = {w["name"]: w["used_blocks"] for w in info["workers"]}
    assert used == {f"colocated-{i}": 0 for i in range(cluster.backend.config.colocated)}
    assert cc.ledger_differences(info) == {} and cc.discrepancies(cluster.port) == 0
    assert all(w["role"] == "colocated" and w["alive"] and w["total_blocks"] == 256 for w in info["workers"])


def test_metrics_report_ttft_and_colocated_pools(cluster):
    cc.complete(cluster.port, {"prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0})
    text = cc.get(cluster.port, "/metrics").decode()
    ttft = "pdserve_time_to_first_token_seconds_count"
    count = [line for line in text.splitlines() if line.startswith(ttft)]
    assert count and float(count[0].split()[-1]) >= 1
    assert 'pdserve_pool_blocks{role="colocated",state="total",worker="colocated-0"} 256.0' in text
    assert "pdserve_migration_latency_seconds_count" not in text  # nothing migrated


def test_client_disconnect_frees_blocks(cluster):
    body = {"prompt": PROMPTS[2], "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    before = cluster.backend.ledger.summary()["failed"]
    with cc.post(cluster.port, body) as r:
        for line in r:
            if line.startswith(b"data: {"):
                break  # tokens are flowing: now hang up
    info = cc.wait_at_rest(cluster.port)
    assert info["ledger"]["active_requests"] == 0 and info["ledger"]["failed"] == before + 1
    assert all(w["used_blocks"] == 0 for w in info["workers"])


def test_dead_colocated_worker_fails_its_stream_and_new_requests_get_503(ray_local):
    import ray

    srv = ClusterServer(ClusterConfig(colocated=1, num_blocks=128, heartbeat_timeout_s=3.0, max_restarts=0))
    try:
        port = srv.start()
        body = {"prompt": PROMPTS[0], "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
        lines = cc.stream_killing(port, body, lambda: ray.kill(srv.backend.workers["colocated-0"].handle,
                                                               no_restart=True))
        assert lines[-1] == "[DONE]"
        err = json.loads(lines[-2])
        assert "colocated worker colocated-0 stopped responding" in err["error"]["message"]
        with pytest.raises(urllib.error.HTTPError) as e:
            cc.complete(port, {"prompt": PROMPTS[0], "max_tokens": 3})
        assert e.value.code == 503
        assert "no live colocated worker" in json.loads(e.value.read())["error"]["message"]
        assert srv.backend.ledger.summary()["active_requests"] == 0
        assert srv.backend.ledger.summary()["failed"] == 1
    finally:
        srv.stop()


def test_up_colocated_flag_and_config_key(tmp_path, capsys):
    import argparse

    from pdserve_cli.cmd_up import DEFAULTS, _settings
    from pdserve_cli.main import main

    assert main(["up", "--colocated", "-1"]) == 2
    assert "--colocated must be at least 0" in capsys.readouterr().err
    cfg = tmp_path / "colo.yaml"
    cfg.write_text("colocated: 3\nprefill: 0\n")
    args = argparse.Namespace(config=str(cfg), **{k: None for k in DEFAULTS})
    s, extras = _settings(args)
    assert s.colocated == 3
    assert ClusterConfig(colocated=s.colocated, prefill=s.prefill, **extras).colocated == 3
