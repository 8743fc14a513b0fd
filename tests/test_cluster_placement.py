"""Placement and addresses on a local Ray: with `bind='node'` the coordinator's report socket and
every decode worker's KV receiver bind on the node's own address (as Ray reports it), inside the
configured ports, while the HTTP API stays on loopback; and with `model_distribution='always'` the
workers load the checkpoint from the coordinator's copy in Ray's object store, fetched once per
node (one worker fetches, the others reuse the node cache), with the local engine's tokens.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket

import pytest

pytest.importorskip("ray")

import cluster_client as cc  # noqa: E402

from coordinator.cluster import ClusterConfig  # noqa: E402
from deploy.launch import ClusterServer  # noqa: E402
from engine.engine import EngineConfig, LLMEngine  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_node_addresses_port_ranges_and_the_model_from_the_object_store(ray_session, tmp_path):
    # ray_session: a plain local Ray on this host's routable address (the embedded Ray of
    # `pdserve up`, ray_local, binds loopback only, so it has no node address to bind to)
    import ray

    from bench.engine_speed import write_random_llama

    checkpoint = write_random_llama(str(tmp_path / "llama"), seed=3)
    event_port, kv_first = _free_port(), _free_port()
    config = ClusterConfig(prefill=1, decode=2, model=checkpoint, num_blocks=64, bind="node",
                           event_port=event_port, kv_port_min=kv_first, kv_port_max=kv_first + 20,
                           model_distribution="always", torch_threads=2, worker_niceness=0)
    srv = ClusterServer(config)
    try:
        port = srv.start()
        node = ray.util.get_node_ip_address()
        assert node != "127.0.0.1"
        assert srv.backend._pull.address == f"tcp://{node}:{event_port}"
        workers = cc.cluster_info(port)["workers"]
        for worker in (w for w in workers if w["role"] == "decode"):
            host, kv_port = worker["address"][len("tcp://"):].rsplit(":", 1)
            assert host == node and kv_first <= int(kv_port) <= kv_first + 20
        sources = sorted(w["model_source"] for w in workers)
        assert sources == ["node_cache", "node_cache", "object_store"]  # three workers, one node
        assert [w["threads"] for w in workers] == [2, 2, 2]  # ClusterConfig.torch_threads
        # this plain Ray starts workers at nice 15; each sets its own to ClusterConfig.worker_niceness
        # where it may (root here; runtime.priority)
        assert [w["niceness"] for w in workers] == [0 if os.geteuid() == 0 else 15] * 3

        local = LLMEngine(EngineConfig(model=checkpoint, num_blocks=64))
        prompt = list(range(3, 40))
        want = cc.reference(local, [prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
        got = cc.complete(port, {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert [c["token_ids"] for c in got["choices"]] == want
    finally:
        published = dict(srv.backend.fleet.published) if srv.backend is not None else {}
        srv.stop()
        _remove_node_cache(published)


def _remove_node_cache(published: dict) -> None:
    from runtime.model_store import CACHE_ROOT

    for entry in published.values():
        shutil.rmtree(os.path.join(CACHE_ROOT, entry["digest"]), ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(CACHE_ROOT, entry["digest"] + ".lock"))


def test_a_config_asking_for_more_gpus_than_the_cluster_has_is_refused_at_start(ray_session):
    import asyncio

    import ray

    from coordinator.cluster import ClusterBackend

    have = ray.cluster_resources().get("GPU", 0)
    backend = ClusterBackend(ClusterConfig(prefill=1, decode=1, engine={"device": "cuda"},
                                           gpus_per_worker=have + 1))
    with pytest.raises(RuntimeError, match=r"asks for .* GPUs .* but the Ray cluster has"):
        asyncio.run(backend.start())
    assert backend.workers == {}  # refused before any worker was placed
