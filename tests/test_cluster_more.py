"""More end-to-end checks of the disaggregated cluster on a local Ray: the real `openai` client, the
`pdserve generate --url` CLI, refusal of an incompatible prefill/decode pair at start, routing
policies across two prefill workers. (Failures: tests/test_cluster_faults.py.)

One Ray and one cluster for the module (2 prefill + 2 decode workers, prefix-aware routing, blocks
of 16), always torn down.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

pytest.importorskip("ray")
openai = pytest.importorskip("openai")

import cluster_client as cc  # noqa: E402

from coordinator.cluster import ClusterBackend, ClusterConfig  # noqa: E402
from deploy.launch import ClusterServer  # noqa: E402

pytestmark = pytest.mark.timeout(300)

CONFIG = ClusterConfig(prefill=2, decode=2, num_blocks=128, routing="prefix_aware")


@pytest.fixture(scope="module")
def cluster(ray_local):
    srv = ClusterServer(CONFIG)
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


# ---- 1. the real openai client ---------------------------------------------------------------------
def test_openai_client_completions_stream_models_and_errors(cluster, local_engine):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.port}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    prompt = "The quick brown fox jumps over"
    want = cc.greedy_ids(local_engine, prompt, max_tokens=12, ignore_eos=True)
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
    # the cluster serves tiny in EngineConfig's own default, f32 (its fingerprint says so)
    assert remote["system_fingerprint"] == "pdserve-f32"
    assert main([*args, "--local", "--model", "tiny", "--weights", "f32"]) == 0
    local = json.loads(capsys.readouterr().out)
    assert remote["choices"] == local["choices"]
    assert remote["system_fingerprint"] == local["system_fingerprint"]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens depends on history
    assert [remote["usage"][k] for k in counts] == [local["usage"][k] for k in counts]
    assert len(local["choices"][0]["token_ids"]) >= 1


# ---- 3. incompatible pair refused at start ---------------------------------------------------------
def test_another_model_of_the_same_shape_is_refused_at_start(ray_local, tmp_path):
    """Equal KV layouts, different weights: the fingerprint's model identity refuses the pair."""
    from bench.engine_speed import write_random_llama

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

    from bench.engine_speed import write_random_llama

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
    before = cc.poll_workers(port, lambda ws: ws[first]["active_requests"] == 0)[first]
    second = cc.complete(port, bodies[1])["pdserve"]["backend"]["prefill_worker"]
    assert second == first
    after = cc.poll_workers(port, lambda ws: ws[first]["prefills"] > before["prefills"])[first]
    assert after["prefills"] == before["prefills"] + 1
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] >= 80  # all 5 shared blocks hit

    cc.set_router(cluster, "prefill", "round_robin")
    try:
        other = [(j * 17) % 250 + 1 for j in range(80)]
        got = [cc.complete(port, {"prompt": other + [t], "max_tokens": 2, "temperature": 0})
               ["pdserve"]["backend"]["prefill_worker"] for t in (1, 2, 3, 4)]
    finally:
        cc.set_router(cluster, "prefill", CONFIG.routing)
    assert got[0] != got[1] and got[0::2] == [got[0]] * 2 and got[1::2] == [got[1]] * 2
