"""`pdserve bench engine` on a tiny run: the result JSON keeps its keys, presets set the prompt
lengths (explicit lengths override), step percentiles are split by kind, and the warm-up leaves
nothing in the engine's prefix cache for the timed prompts. No timing is asserted."""

import json

import pytest

pytest.importorskip("transformers")

from bench.engine_speed import run, run_engine, write_random_llama  # noqa: E402


def test_warm_up_does_not_warm_the_prefix_cache(tmp_path):
    ckpt = write_random_llama(str(tmp_path / "llama"), seed=1, vocab=300, hidden=64, layers=2, heads=4,
                              kv_heads=2, intermediate=160)
    prompts = [[1] + list(range(3, 40)), [1] + list(range(50, 90)), [1] + list(range(100, 120))]
    result = run_engine(ckpt, prompts, max_tokens=3, block_size=4, max_batched_tokens=16, dtype="float32",
                        progress=lambda n: None)
    assert result["prefix_hit_tokens"] == 0  # prompts[:2] were the warm-up
    assert result["tokens"] == 9 and [len(o) for o in result["outputs"]] == [3, 3, 3]
    assert result["prefill_step_ms"]["count"] + result["decode_step_ms"]["count"] == result["steps"]


@pytest.mark.parametrize("preset,lengths,want", [("long", (None, None), [480, 512]),
                                                 ("short", (20, 21), [20, 21])])
def test_result_keys_and_presets(tmp_path, preset, lengths, want):
    path = tmp_path / "engine.json"
    result = run(num_prompts=2, max_tokens=2, repeats=1, preset=preset, min_prompt=lengths[0],
                 max_prompt=lengths[1], json_path=str(path))
    body = json.loads(path.read_text())
    assert body["config"]["prompt_len"] == want and body["config"]["model"] == "tiny"
    for key in ("speedup_vs_transformers", "identical_outputs", "ratios", "num_prompts"):
        assert key in body
    assert len(body["pdserve"]["runs"]) == len(body["transformers"]["runs"]) == 1
    assert {"step_ms", "prefill_step_ms", "decode_step_ms"} <= set(body["pdserve"]["runs"][0])
    assert result["speedup_vs_transformers"] == body["speedup_vs_transformers"]
