"""The continuous-batching engine: equality with transformers through the paged cache,
prefix caching, n > 1 sharing, beam search block accounting, and preemption by recompute and swap."""

import pytest
import torch

from bench.engine_speed import write_random_llama
from engine.engine import EngineConfig, LLMEngine, RequestError
from engine.sampling import SamplingParams
from engine.scheduler import SchedulerConfig

GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_random_llama(str(tmp_path_factory.mktemp("llama")), seed=3, vocab=300, hidden=64, layers=2,
                              heads=4, kv_heads=2, intermediate=160)


@pytest.fixture(scope="module")
def loaded(llama_dir):
    from engine.attention import get_backend
    from engine.loader import load_model

    return load_model(llama_dir, device="cpu", dtype=None, backend=get_backend("torch"))


def _engine(loaded, **kw) -> LLMEngine:
    sched = kw.pop("scheduler", SchedulerConfig())
    return LLMEngine(EngineConfig(scheduler=sched, **kw), loaded=loaded)


def _prompts():
    g = torch.Generator().manual_seed(7)
    lens = [5, 17, 33, 1 + 16 * 2, 50]
    return [[1] + torch.randint(3, 300, (n - 1,), generator=g).tolist() for n in lens]


def _hf_greedy(llama_dir, prompts, n):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(llama_dir, torch_dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.inference_mode():
            g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                               min_new_tokens=n, do_sample=False, pad_token_id=0)
        out.append(g[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module")
def hf_reference(llama_dir):
    return _hf_greedy(llama_dir, _prompts(), GREEDY.max_tokens)


@pytest.mark.parametrize("block_size", [1, 16])
def test_batched_greedy_equals_transformers(loaded, hf_reference, block_size):
    eng = _engine(loaded, block_size=block_size, num_blocks=4096 // block_size)
    done = eng.generate(_prompts(), GREEDY)
    assert [c.choices[0]["token_ids"] for c in done] == hf_reference
    assert eng.kv.allocator.num_used == 0
    eng.kv.check_integrity()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_greedy_output(loaded, hf_reference, mode):
    # 5 prompts of up to 50 + 32 tokens need ~30 blocks of 4 each at once; 24 forces preemption.
    eng = _engine(loaded, block_size=4, num_blocks=24, num_host_blocks=64,
                  scheduler=SchedulerConfig(preemption_mode=mode))
    done = eng.generate(_prompts(), GREEDY)
    assert eng.scheduler.preemptions > 0
    assert eng.scheduler.swap_fallbacks == 0
    assert [c.choices[0]["token_ids"] for c in done] == hf_reference
    assert eng.kv.allocator.num_used == 0 and eng.kv.host_allocator.num_used == 0
    eng.kv.check_integrity()


def test_prefix_cache_prefills_only_the_suffix(loaded):
    eng = _engine(loaded, block_size=4, num_blocks=256)
    shared = _prompts()[4][:40]
    a, b = shared + [5, 6, 7], shared + [9, 10]
    [first] = eng.generate([a], GREEDY)
    before = eng.kv.prefix_hit_tokens
    [second] = eng.generate([b], GREEDY)
    assert eng.kv.prefix_hit_tokens - before == 40  # ten full blocks of 4 reused
    cold = _engine(loaded, block_size=4, num_blocks=256, enable_prefix_caching=False)
    [ref] = cold.generate([b], GREEDY)
    assert second.choices[0]["token_ids"] == ref.choices[0]["token_ids"]
    assert first.choices[0]["token_ids"] != second.choices[0]["token_ids"] or a != b


def test_parallel_sampling_counts_prompt_blocks_once(loaded):
    eng = _engine(loaded, block_size=4, num_blocks=256)
    prompt = _prompts()[4][:22]  # 5 full blocks + a tail of 2
    rid = eng.add_request(prompt, SamplingParams(max_tokens=8, n=4, temperature=1.0, seed=11))
    eng.step()  # prefill + fork into 4 sequences
    assert eng.kv.allocator.num_used == 6  # the prompt's blocks, once
    table = eng.kv.table(eng.requests[rid].seqs[0].seq_id)
    assert all(eng.kv.allocator.ref_count(b) == 4 for b in table.blocks)
    eng.step()  # each sequence writes its first token: copy-on-write of the shared tail
    assert eng.kv.allocator.num_used == 5 + 4
    while eng.has_work():
        eng.step()
    assert eng.kv.allocator.num_used == 0
    eng.kv.check_integrity()


def test_seeded_sampling_is_reproducible_and_seed_dependent(loaded):
    p = _prompts()[1]

    def run(seed, n=3):
        eng = _engine(loaded, block_size=16, num_blocks=256)
        [c] = eng.generate([p], SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=seed, n=n,
                                               ignore_eos=True))
        return [ch["token_ids"] for ch in c.choices]

    a, b, c = run(5), run(5), run(6)
    assert a == b
    assert a != c
    assert len({tuple(x) for x in a}) > 1  # the n samples differ from one another


def test_top_k_one_is_greedy(loaded):
    eng = _engine(loaded, block_size=16, num_blocks=256)
    [g] = eng.generate([_prompts()[2]], GREEDY)
    [k1] = eng.generate([_prompts()[2]], SamplingParams(max_tokens=32, temperature=1.3, top_k=1, seed=1,
                                                        ignore_eos=True))
    assert g.choices[0]["token_ids"] == k1.choices[0]["token_ids"]


def test_stop_token_ends_generation(loaded):
    eng = _engine(loaded, block_size=16, num_blocks=256)
    [g] = eng.generate([_prompts()[0]], GREEDY)
    ids = g.choices[0]["token_ids"]
    stop = ids[5]
    params = SamplingParams(max_tokens=32, stop_token_ids=(stop,), ignore_eos=True)
    [s] = eng.generate([_prompts()[0]], params)
    first = ids.index(stop)
    assert s.choices[0]["token_ids"] == ids[:first + 1]
    assert s.choices[0]["finish_reason"] == "stop"


def test_beam_search_blocks_track_live_beams(loaded):
    eng = _engine(loaded, block_size=4, num_blocks=256)
    rid = eng.add_request(_prompts()[3], SamplingParams(max_tokens=10, beam_width=4, n=2, ignore_eos=True))
    req = eng.requests[rid]
    saw_sharing = False
    while eng.has_work():
        eng.step()
        named = set()
        for s in req.live_seqs:
            named |= set(eng.kv.table(s.seq_id).blocks)
        assert eng.kv.allocator.num_used == len(named)  # nothing held by a pruned beam
        refs = [eng.kv.allocator.ref_count(b) for b in named]
        saw_sharing |= any(r > 1 for r in refs)
        eng.kv.check_integrity()
    assert saw_sharing
    assert eng.kv.allocator.num_used == 0
    assert [s.index for s in req.seqs] == [0, 1] and all(len(s.output_ids) == 10 for s in req.seqs)
    assert req.seqs[0].cum_logprob >= req.seqs[1].cum_logprob


def test_bad_requests_are_refused(loaded):
    eng = _engine(loaded, block_size=16, num_blocks=64)
    with pytest.raises(RequestError, match="empty"):
        eng.add_request([], GREEDY)
    with pytest.raises(RequestError, match="vocabulary"):
        eng.add_request([1, 5000], GREEDY)
    with pytest.raises(RequestError, match="context"):
        eng.add_request([1] * 2040, GREEDY)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    assert not eng.has_work()


def test_abort_returns_every_block(loaded):
    eng = _engine(loaded, block_size=4, num_blocks=128)
    rid = eng.add_request(_prompts()[4], SamplingParams(max_tokens=20, n=3, temperature=1.0, seed=2))
    eng.step()
    eng.step()
    assert eng.kv.allocator.num_used > 0
    assert eng.abort(rid)
    assert eng.kv.allocator.num_used == 0 and not eng.has_work()
    eng.kv.check_integrity()


def test_triton_backend_gives_the_same_greedy_tokens(loaded, llama_dir):
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 (make test sets it)")
    from engine.attention import get_backend
    from engine.loader import load_model

    # Compiled Triton kernels need CUDA tensors: on a GPU host both sides run there (float32).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        loaded = load_model(llama_dir, device=device, dtype="float32", backend=get_backend("torch"))
    tri = load_model(llama_dir, device=device, dtype="float32", backend=get_backend("triton"))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = _prompts()[:3]
    a = _engine(loaded, block_size=16, num_blocks=64, device=device).generate(prompts, params)
    triton_engine = _engine(tri, block_size=16, num_blocks=64, attention_backend="triton", device=device)
    b = triton_engine.generate(prompts, params)
    assert [c.choices for c in a] == [c.choices for c in b]


def test_model_identity_is_stable_and_tells_models_of_one_shape_apart():
    """The KV fingerprint names the model: same weights -> same identity; one changed weight of the
    same shape, or another config, -> another identity (such pools never exchange blocks)."""
    import dataclasses

    from engine.identity import model_identity
    from engine.loader import load_model

    model, config, _ = load_model("tiny")
    again, config2, _ = load_model("tiny")
    ident = model_identity(config, model)
    assert len(ident) == 16 and ident == model_identity(config2, again)
    with torch.no_grad():
        again.state_dict()["embed_tokens.weight"][0, 0] += 1.0
    assert model_identity(config2, again) != ident
    assert model_identity(dataclasses.replace(config, rms_norm_eps=1e-3), model) != ident


def test_blocks_held_back_for_imports_are_left_alone_by_running_sequences(loaded, hf_reference):
    """A decode worker holds back the room it promised to coming migrations (`kv.held_back`): its
    running sequences preempt rather than grow into it, the held-back blocks stay allocatable by
    an import (which allocates directly), and greedy output is unchanged."""
    eng = _engine(loaded, block_size=4, num_blocks=40)
    for i, p in enumerate(_prompts()):
        eng.add_request(p, GREEDY, request_id=f"r{i}")
    outputs: dict[str, list[int]] = {}
    promised = eng.kv.allocator.num_available - 12  # most of the room is promised elsewhere
    eng.kv.held_back = lambda: promised
    while eng.has_work():
        for o in eng.step():
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert eng.kv.allocator.num_available >= promised  # never grown into
        if eng.scheduler.preemptions and promised:
            imported = eng.kv.allocator.allocate_many(promised)  # the imports land
            assert imported is not None
            eng.kv.allocator.free_many(imported[::-1])  # (and finish)
            promised = 0
    assert eng.scheduler.preemptions > 0
    assert [outputs[f"r{i}"] for i in range(len(hf_reference))] == hf_reference
    eng.kv.check_integrity()
