"""End to end on a local Ray: the disaggregated cluster (prefill + decode actors, KV migrated over
transfer/) behind the HTTP API gives the same tokens as the in-process engine.

One Ray and one cluster per transport for the whole module (started once, always torn down):
  zmq: 2 prefill + 2 decode workers, round robin, prefill blocks of 16 and decode blocks of 32
       (every migration is re-blocked);
  ray: 1 prefill + 1 decode worker, prefill blocks of 16, decode blocks of 8 (re-blocked too);
  nixl: 1 prefill + 1 decode worker, blocks of 16 on both (the decode worker reads the payload
       from the prefill worker's pool with NIXL; skipped without nixl).
Failures: tests/test_cluster_faults.py.
"""

from __future__ import annotations

import concurrent.futures
import urllib.error
import urllib.request

import pytest

pytest.importorskip("ray")

import cluster_client as cc  # noqa: E402

from coordinator.cluster import ClusterConfig  # noqa: E402
from deploy.launch import ClusterServer  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.timeout(300)

# NOTE: step_target_s=0 (a fixed step budget): paced steps would split a prompt into chunks when the
# machine is slow, and a chunked prompt migrates streamed (queried: fewer bytes), which the dedupe
# test below tells apart by its byte counts
PACE = {"step_target_s": 0.0}
PROMPTS = [list(range(1, 6)), list(range(10, 26)), list(range(30, 63)), [7, 8, 9] * 17]
CLUSTERS = {
    "zmq": ClusterConfig(prefill=2, decode=2, transport="zmq", block_size=16, decode_block_size=32,
                         num_blocks=256, routing="round_robin", **PACE),
    "ray": ClusterConfig(prefill=1, decode=1, transport="ray", block_size=16, decode_block_size=8,
                         num_blocks=256, **PACE),
    "nixl": ClusterConfig(prefill=1, decode=1, transport="nixl", block_size=16, num_blocks=256, **PACE),
}


@pytest.fixture(scope="module", params=sorted(CLUSTERS))
def cluster(request, ray_local):
    if request.param == "nixl":  # NOTE: an optional dependency
        pytest.importorskip("nixl")
    srv = ClusterServer(CLUSTERS[request.param])
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


def test_greedy_tokens_equal_local_engine(cluster, local_engine):
    want = cc.reference(local_engine, PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    for prompt, ref in zip(PROMPTS, want):
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        got = cc.complete(cluster.port, body)
        assert [c["token_ids"] for c in got["choices"]] == ref
        mig = got["pdserve"]["backend"]["migration"]
        assert mig["seqs"] == 1 and mig["bytes"] > 0 and mig["blocks"] >= 1
        assert got["usage"]["completion_tokens"] == 12


def test_sampled_n2_stream_continues_identically(cluster, local_engine):
    """Counter-based seeds: a sampled stream migrated after its first token equals the local one."""
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=50, seed=1234, n=2, ignore_eos=True)
    want = cc.reference(local_engine, [PROMPTS[2]], params)[0]
    got = cc.complete(cluster.port, {"prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0.9, "top_k": 50,
                                   "seed": 1234, "n": 2, "ignore_eos": True})
    assert [c["token_ids"] for c in sorted(got["choices"], key=lambda c: c["index"])] == want
    assert got["pdserve"]["backend"]["migration"]["seqs"] == 2


def test_streaming_equals_non_streaming(cluster):
    body = {"prompt": PROMPTS[3], "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    whole = cc.complete(cluster.port, body)
    assert cc.stream(cluster.port, body) == {c["index"]: c["token_ids"] for c in whole["choices"]}


def test_first_token_only_request_finishes_on_prefill(cluster, local_engine):
    want = cc.reference(local_engine, [PROMPTS[1]], SamplingParams(max_tokens=1))[0]
    got = cc.complete(cluster.port, {"prompt": PROMPTS[1], "max_tokens": 1, "temperature": 0})
    assert [c["token_ids"] for c in got["choices"]] == want
    assert got["pdserve"]["backend"]["decode_worker"] is None


def test_concurrent_requests_complete_and_ledger_reconciles(cluster, local_engine):
    prompts = [[(i * 7 + j) % 250 + 1 for j in range(5 + 3 * i)] for i in range(32)]
    want = cc.reference(local_engine, prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        futs = [pool.submit(cc.complete, cluster.port, {"prompt": p, "max_tokens": 10, "temperature": 0,
                                                      "ignore_eos": True}) for p in prompts]
        got = [[c["token_ids"] for c in f.result(timeout=120)["choices"]] for f in futs]
    assert got == want
    info = cc.wait_at_rest(cluster.port)
    assert info["ledger"]["active_requests"] == 0 and info["ledger"]["owned_blocks"] == 0
    assert info["ledger"]["failed"] == 0
    used = {w["name"]: w["used_blocks"] for w in info["workers"]}
    assert used == {w["name"]: 0 for w in info["workers"]}
    assert cc.ledger_differences(info) == {} and cc.discrepancies(cluster.port) == 0
    assert {w["role"] for w in info["workers"]} == {"prefill", "decode"}
    assert all(w["alive"] and w["total_blocks"] == 256 for w in info["workers"])
    # the prefix cache keeps full prompt blocks on both sides (cached, not used)
    assert all(w["cached_blocks"] > 0 for w in info["workers"])


def test_client_disconnect_frees_blocks_everywhere(cluster):
    body = {"prompt": PROMPTS[2], "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with cc.post(cluster.port, body) as r:
        for line in r:
            if line.startswith(b"data: {"):
                break  # tokens are flowing: now hang up
    info = cc.wait_at_rest(cluster.port)
    assert info["ledger"]["active_requests"] == 0
    assert all(w["used_blocks"] == 0 for w in info["workers"])
    assert info["ledger"]["failed"] >= 1  # the aborted request is recorded as failed, not finished


def test_bad_input_gets_400_and_server_stays_healthy(cluster):
    with pytest.raises(urllib.error.HTTPError) as e:
        cc.complete(cluster.port, {"prompt": [5, 6, 99999], "max_tokens": 4})
    assert e.value.code == 400
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.port}/health", timeout=10) as r:
        assert r.status == 200


def test_metrics_and_cluster_info_describe_the_workers(cluster):
    cc.complete(cluster.port, {"prompt": PROMPTS[2], "max_tokens": 3, "temperature": 0})
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.port}/metrics", timeout=10) as r:
        text = r.read().decode()
    transport = cluster.backend.config.transport
    assert f'pdserve_migration_latency_seconds_count{{transport="{transport}"}}' in text
    phases = ["query", "export", "wire", "prepare", "commit"]
    phases += ["land", "verify"] if transport == "zmq" else []  # the bulk link's phases
    for phase in phases:  # where the milliseconds of each migration went
        assert f'pdserve_migration_phase_seconds_count{{phase="{phase}",transport="{transport}"}}' in text
    assert 'pdserve_pool_blocks{role="decode",state="total",worker="decode-0"}' in text
    info = cc.cluster_info(cluster.port)
    assert info["transport"] == transport and info["mode"] == "cluster"
    assert info["transport_capabilities"]["one_sided"] == (transport == "nixl")  # transfer.registry
    sizes = {w["role"]: w["block_size"] for w in info["workers"]}
    cfg = cluster.backend.config
    assert sizes == {"prefill": cfg.block_size, "decode": cfg.decode_block_size or cfg.block_size}
    assert all(w["address"].startswith("tcp://") or w["address"].startswith("ray://")
               for w in info["workers"] if w["role"] == "decode")


def test_up_refuses_bad_arguments_before_starting_anything(tmp_path, capsys):
    from pdserve_cli.main import main

    assert main(["up", "--prefill", "0"]) == 2
    assert main(["up", "--model", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "--prefill and --decode must be at least 1" in err and "checkpoint directory" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("prefill: 1\nwarp_drive: true\n")
    assert main(["up", "--config", str(bad)]) == 2
    assert "unknown setting 'warp_drive'" in capsys.readouterr().err
    zero = tmp_path / "zero.yaml"
    zero.write_text("decode: 0\n")
    assert main(["up", "--config", str(zero)]) == 2  # file values are checked like flags
    assert "must be at least 1" in capsys.readouterr().err


def test_shipped_configs_parse_into_cluster_configs():
    import argparse
    import pathlib

    from coordinator.cluster import ClusterConfig
    from pdserve_cli.cmd_up import DEFAULTS, _settings

    for name in ("local.yaml", "multinode.yaml"):
        path = pathlib.Path(__file__).parent.parent / "deploy" / name
        args = argparse.Namespace(config=str(path), **{k: None for k in DEFAULTS})
        s, extras = _settings(args)
        cfg = ClusterConfig(prefill=s.prefill, decode=s.decode, transport=s.transport, model=s.model,
                            block_size=s.block_size, routing=s.routing, **extras)
        assert cfg.prefill >= 1 and cfg.transport in ("zmq", "ray")
    assert cfg.prefill_resources and cfg.decode_resources  # multinode places the roles apart
    assert s.address == "auto" and s.host == "0.0.0.0"  # joins the running cluster, HTTP on every interface
    assert cfg.engine["device"] == "cuda" and cfg.gpus_per_worker == 1 and cfg.bind == "auto"
    assert cfg.model.startswith("/models/")

    import yaml

    manifest = yaml.safe_load((pathlib.Path(__file__).parent.parent / "deploy" / "kuberay-raycluster.yaml")
                              .read_text())
    head = manifest["spec"]["headGroupSpec"]["template"]["spec"]
    mounts = {m["mountPath"] for m in head["containers"][0]["volumeMounts"]}
    assert {"/models", "/config"} <= mounts  # the model volume and the pdserve config
    decode = manifest["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert "/models" in {m["mountPath"] for m in decode["volumeMounts"]}


def test_repeated_prompt_sends_only_blocks_the_decode_side_lacks(cluster):
    """Dedupe through migrate: once a decode worker holds a prompt's full blocks (prefix cache),
    later migrations of that prompt to it share them instead of holding a second copy. This
    payload is under TransportConfig.inline_bytes, so it goes in one round trip without a dedupe
    query: every byte travels and the decode side drops the blocks it holds (the queried path,
    which sends fewer bytes, is tested in test_transfer_zmq.py)."""
    prompt = [(j * 13) % 250 + 1 for j in range(70)]
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    migs = [cc.complete(cluster.port, body)["pdserve"]["backend"]["migration"] for _ in range(3)]
    assert migs[0]["reused"] == 0
    assert max(m["reused"] for m in migs[1:]) > 0
    assert all(m["bytes"] == migs[0]["bytes"] for m in migs) and migs[0]["bytes"] <= 256 << 10
