"""Decode steps as CUDA graphs (engine.cuda_graphs). CPU tier: the static path without capture,
under TRITON_INTERPRET=1 (the Triton backend's kernels interpreted): a padded bucket gives the
same logits and K/V as the unpadded eager step, padding rows store nothing (not even a row a
larger step used before), steps a graph cannot serve are refused, and the Triton engine with
graphs gives the torch engine's greedy tokens. On a CUDA machine the same tests capture and replay
real graphs (bench/gpu_session.sh runs this file)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402

from bench.engine_speed import write_random_llama  # noqa: E402
from engine.attention import get_backend  # noqa: E402
from engine.attn_metadata import AttentionMetadata  # noqa: E402
from engine.cuda_graphs import DecodeGraphs, buckets_up_to  # noqa: E402
from engine.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.loader import load_model  # noqa: E402
from kvcache.storage import KVStorage  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CAPTURE = DEV == "cuda"
B = 16


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_random_llama(str(tmp_path_factory.mktemp("llama")), seed=5, vocab=300, hidden=64, layers=2,
                              heads=4, kv_heads=2, intermediate=160)


@pytest.fixture(scope="module")
def triton_model(llama_dir):
    if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 (make test sets it)")
    model, config, _ = load_model(llama_dir, device=DEV, dtype="float32", backend=get_backend("triton"))
    return model, config


def _pool(config, num_blocks=24):
    """A pool of random K/V (the null block stays zero)."""
    storage = KVStorage(config.kv_layout(B, "float32", "test"), num_blocks, DEV, null_block=True)
    gen = torch.Generator(device=DEV).manual_seed(1)
    storage.data.copy_(torch.randn(storage.data.shape, generator=gen, device=DEV))  # (N, L, 2, B, H, D)
    return storage


def _step(lens: list[int], first_block: int):
    """A decode step: sequence s holds lens[s] tokens after it (its own run of blocks from
    first_block on); returns the metadata and (S,) token ids."""
    tables, nxt = [], first_block
    for n in lens:
        nb = -(-n // B)
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
    meta = AttentionMetadata.build(tables, lens, [1] * len(lens), B, DEV, null_block=None)
    ids = torch.tensor([7 + 11 * s for s in range(len(lens))], dtype=torch.int64, device=DEV)
    return meta, ids


def _eager(model, storage, meta, ids):
    with torch.inference_mode():
        return model.compute_logits(model.forward(ids, meta.positions, storage, meta)).float()


def test_buckets_are_powers_of_two_up_to_the_largest():
    assert buckets_up_to(64) == (1, 2, 4, 8, 16, 32, 64)
    assert buckets_up_to(12) == (1, 2, 4, 8, 12)
    assert buckets_up_to(1) == (1,)
    assert buckets_up_to(0) == ()


def test_padded_bucket_matches_the_eager_step_and_padding_stores_nothing(triton_model):
    """4 sequences, then 3 in the same bucket of 4 (row 3 held a live slot a step before), then 1.
    Each: logits and the stored K/V as the unpadded eager step's; every other slot, the null block
    included, as it was."""
    model, config = triton_model
    storage = _pool(config)
    null = storage.null_block_id
    graphs = DecodeGraphs(model, storage, B, max_blocks=6, max_batch=4, capture=CAPTURE)
    assert graphs.capture_all()
    assert bool(graphs.graphs) == CAPTURE
    for lens in ([20, 5, 33, 17], [21, 6, 34], [40]):
        meta, ids = _step(lens, first_block=1)
        before = storage.data.clone()
        want = _eager(model, storage, meta, ids)
        after_eager = storage.data.clone()
        storage.data.copy_(before)
        b = graphs.bucket(meta)
        assert b == (4 if len(lens) > 2 else 1)
        got = graphs.run(ids, meta, b).clone()
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(storage.data, after_eager, atol=1e-5, rtol=1e-5)
        changed = (storage.data != before).flatten(4).any(-1)  # (N, L, 2, B): a slot's K or V changed
        written = {blk * B + off for blk, _, _, off in changed.nonzero().tolist()}
        assert written <= set(meta.slot_mapping.tolist()), "padding rows stored K/V"
        k_layer0 = storage.layer_view(0)[0]  # (N + 1, B, H, D): the null block included
        assert not k_layer0[null].any(), "the null block must stay zero"
    assert graphs.replays == 3


def test_steps_a_graph_cannot_serve_run_eagerly(triton_model):
    model, config = triton_model
    graphs = DecodeGraphs(model, _pool(config), B, max_blocks=2, max_batch=2, capture=False)
    assert graphs.bucket(_step([10, 12], 1)[0]) == 2
    assert graphs.bucket(_step([10, 12, 3], 1)[0]) is None            # more than the largest bucket
    assert graphs.bucket(_step([40], 1)[0]) is None                   # 3 blocks > the static width 2
    prefill = AttentionMetadata.build([[1, 2]], [20], [4], B, DEV)
    assert graphs.bucket(prefill) is None                             # not decode-only


def test_triton_engine_with_graphs_gives_the_torch_engines_greedy_tokens(llama_dir, triton_model):
    """Prompts finish at different steps, so the batch walks down the buckets (5 -> 8, then 4, 2, 1)."""
    torch_loaded = load_model(llama_dir, device=DEV, dtype="float32", backend=get_backend("torch"))
    model, config = triton_model
    gen = torch.Generator().manual_seed(3)
    prompts = [[1] + torch.randint(3, 300, (n,), generator=gen).tolist() for n in (4, 19, 33, 8, 47)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (3, 9, 5, 7, 4)]
    want = LLMEngine(EngineConfig(block_size=B, num_blocks=64, device=DEV), loaded=torch_loaded).generate(
        prompts, params)
    eng = LLMEngine(EngineConfig(block_size=B, num_blocks=64, attention_backend="triton", device=DEV,
                                 cuda_graphs=8), loaded=(model, config, torch_loaded[2]))
    if not CAPTURE:  # CPU: the engine captures nothing; the static path serves its decode steps
        eng.graphs = DecodeGraphs(eng.model, eng.storage, B, 8, 8, capture=False)
    got = eng.generate(prompts, params)
    assert [c.choices[0]["token_ids"] for c in got] == [c.choices[0]["token_ids"] for c in want]
    assert eng.graphs.replays >= 8  # every decode step (max_tokens 9: 8 decode steps at least)
    assert eng.kv.allocator.num_used == 0


def test_graphs_bench_times_both_paths_and_finds_the_same_logits(llama_dir, triton_model):
    from bench.decode_graphs import run

    out = run(llama_dir, "float32", [1, 3], context=20, block_size=B, iters=1)
    assert [r["bucket"] for r in out["rows"]] == [1, 3]  # buckets up to the largest batch: 1, 2, 3
    assert out["captured"]
    for r in out["rows"]:
        assert r["eager_ms"] > 0 and r["graph_ms"] > 0
        assert r["max_abs_logit_diff"] < 1e-4
