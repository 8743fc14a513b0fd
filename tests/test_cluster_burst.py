"""A busy worker is not a dead worker, on a real cluster: eight simultaneous 256-token prompts
against a one-thread SmolLM2 prefill worker with the default settings (a 5 s heartbeat timeout).
Before the worker heartbeat moved off the engine loop and steps were paced by time, the first
step held all 2,048 prompt tokens (4-8 s on one core here), the coordinator declared the prefill
worker dead and 7 of 8 requests got 503. Now every request is answered, no worker is replaced,
and each answer equals the in-process engine's greedy tokens.
"""

from __future__ import annotations

import concurrent.futures

import pytest

pytest.importorskip("ray")

import cluster_client as cc  # noqa: E402
from smollm2_helpers import SKIP, smollm2_path  # noqa: E402

from coordinator.cluster import ClusterConfig  # noqa: E402
from deploy.launch import ClusterServer  # noqa: E402

pytestmark = [pytest.mark.timeout(600), SKIP]

PROMPTS = [[(1000 + 97 * i + 13 * j) % 40000 + 100 for j in range(256)] for i in range(8)]
MAX_TOKENS = 3


@pytest.fixture(scope="module")
def reference():
    from smollm2_helpers import engine_model

    from engine.engine import EngineConfig, LLMEngine
    from engine.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model=smollm2_path(), num_blocks=256), loaded=engine_model())
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [c.choices[0]["token_ids"] for c in engine.generate(PROMPTS, params)]


def test_burst_of_long_prompts_is_served_without_killing_the_busy_worker(ray_local, reference):
    srv = ClusterServer(ClusterConfig(prefill=1, decode=1, model=smollm2_path(), num_blocks=256))
    try:
        port = srv.start()
        before = set(cc.workers(port))
        body = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(lambda p: cc.complete(port, {**body, "prompt": p}), PROMPTS))
        assert [a["choices"][0]["token_ids"] for a in answers] == reference
        info = cc.cluster_info(port)
        assert set(cc.workers(port)) == before and not info["empty_slots"]
        assert all(w["alive"] for w in info["workers"])
        prefill = next(w for w in info["workers"] if w["role"] == "prefill")
        assert prefill["step_us_per_token"] > 0 and 16 <= prefill["step_budget"] <= 2048  # paced by time
    finally:
        srv.stop()
