"""engine.warmup: the dummy prompts a worker runs at start leave nothing behind (blocks, cached
prefixes, requests, step counts, the pacer's fit) and change no later token."""

import pytest

from engine.engine import EngineConfig, LLMEngine
from engine.warmup import warm_up, warmup_prompts
from protocol.sampling import SamplingParams

KEYS = ("free_blocks", "cached_blocks", "used_blocks")


def _engine(role: str = "colocated") -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", block_size=16, num_blocks=256, role=role))


@pytest.mark.parametrize("role", ["colocated", "prefill", "decode"])
def test_a_warm_up_leaves_the_engine_as_it_started(role):
    e = _engine(role)
    before = {k: e.kv.usage()[k] for k in KEYS}
    prompts = warmup_prompts(e)
    assert len(prompts) == 2 and len(prompts[1]) > len(prompts[0]) >= 2 * 16
    assert warm_up(e) > 0
    assert {k: e.kv.usage()[k] for k in KEYS} == before
    assert not e.requests and not e.prefilled and not e.has_work()
    assert e.steps == 0 and e.scheduler.pacer.steps == 0
    assert e.kv.enable_prefix_caching
    for p in prompts:  # no block of theirs was registered: a real prompt equal to one hits nothing
        assert e.kv.match_prefix(p) == []


def test_greedy_tokens_after_a_warm_up_equal_a_cold_engine_s():
    prompts = [[5, 9, 13, 2, 7] * 9, warmup_prompts(_engine())[0]]  # the second: a warm-up prompt itself
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    cold = [c.choices[0]["token_ids"] for c in _engine().generate(prompts, params)]
    warm_engine = _engine()
    warm_up(warm_engine)
    warm = [c.choices[0]["token_ids"] for c in warm_engine.generate(prompts, params)]
    assert warm == cold and all(len(t) == 8 for t in warm)
    assert warm_engine.kv.prefix_hit_tokens == 0
