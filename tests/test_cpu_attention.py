"""The compiled CPU decode kernel (engine.cpu_attention) against a float64 reference.

Property-based over shapes (head size, query heads per kv head, block size, ragged lengths from
1 to several blocks, shuffled and shared blocks, garbage everywhere no live key is), on a pool's
strided layer views like the engine's; then scores large enough to saturate the softmax, thread
counts (the same bits with 1 and 2), the backend's mixed steps (decode rows through the kernel,
prefill rows through the torch paths, decode rows consecutive or not), every refusal, and a
machine without a C compiler (the engine falls back to the decode mirror).
"""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import attn_torch, cpu_attention, cpu_kernels
from engine.attn_metadata import AttentionMetadata
from kvcache.storage import KVLayout, KVStorage

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler for the kernel")


def _storage(kv_heads: int, head_dim: int, block: int, num_blocks: int, seed: int) -> KVStorage:
    storage = KVStorage(KVLayout(2, kv_heads, head_dim, block), num_blocks, null_block=True)
    gen = torch.Generator().manual_seed(seed)
    storage.data.copy_(torch.randn(storage.data.shape, generator=gen))  # garbage outside live keys
    return storage


def _reference(q, k_cache, v_cache, tables, lens, scale):
    """(n, Hq, D) float64 attention of each query over its sequence's keys 0..len-1."""
    n, Hq, D = q.shape
    group = Hq // k_cache.shape[2]
    out = torch.empty(n, Hq, D, dtype=torch.float64)
    for i, (table, length) in enumerate(zip(tables, lens)):
        keys = torch.cat([k_cache[b] for b in table])[:length].double()  # (len, Hkv, D)
        values = torch.cat([v_cache[b] for b in table])[:length].double()
        for h in range(Hq):
            probs = torch.softmax(keys[:, h // group] @ q[i, h].double() * scale, 0)  # (len,)
            out[i, h] = probs @ values[:, h // group]
    return out


def _batch(rng: random.Random, lens: list[int], block: int, num_blocks: int, share: bool):
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = [[ids.pop() for _ in range(-(-n // block))] for n in lens]
    if share and len(tables) > 1:  # a forked sequence: its first block is another's
        tables[1][0] = tables[0][0]
    return tables


@settings(max_examples=40, deadline=None)
@given(head_dim=st.sampled_from([16, 32, 48, 64, 128]), group=st.sampled_from([1, 2, 3, 4, 8]),
       kv_heads=st.integers(1, 3), block=st.sampled_from([1, 4, 16]),
       lens=st.lists(st.integers(1, 70), min_size=1, max_size=6), share=st.booleans(),
       seed=st.integers(0, 2**16))
def test_kernel_matches_reference(head_dim, group, kv_heads, block, lens, share, seed):
    rng = random.Random(seed)
    need = sum(-(-n // block) for n in lens)
    storage = _storage(kv_heads, head_dim, block, need + 3, seed)
    k_cache, v_cache = storage.layer_view(1)  # strided: layer 1 of 2, keys and values interleaved
    tables = _batch(rng, lens, block, need + 3, share)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen)
    scale = head_dim ** -0.5
    batch = cpu_attention.DecodeBatch.build(tables, lens, block)
    out = cpu_attention.paged_decode(q, k_cache, v_cache, batch, scale)
    ref = _reference(q, k_cache, v_cache, tables, lens, scale)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-5)


def test_saturated_softmax_and_threads():
    """Scores hundreds apart (e^x underflows for most keys, one key takes all the weight) match
    the reference; 1 and 2 threads give the same bits."""
    rng = random.Random(5)
    lens = [1, 17, 64, 33, 100, 5, 48, 80]
    storage = _storage(2, 32, 16, 40, 5)
    k_cache, v_cache = storage.layer_view(0)
    tables = _batch(rng, lens, 16, 40, False)
    batch = cpu_attention.DecodeBatch.build(tables, lens, 16)
    q = torch.randn(len(lens), 4, 32, generator=torch.Generator().manual_seed(1)) * 40
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(cpu_attention.paged_decode(q, k_cache, v_cache, batch, 1.0))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    assert torch.isfinite(outs[0]).all()
    torch.testing.assert_close(outs[0].double(), _reference(q, k_cache, v_cache, tables, lens, 1.0),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("order", ["decode_first", "interleaved"])
def test_backend_mixed_step_uses_kernel_for_decode_rows(order):
    """attn_torch.forward with a kernel workspace: decode rows from the kernel, prefill rows
    (fresh and after a cached prefix) from the torch paths, all equal to the reference."""
    rng = random.Random(2)
    q_lens = [1, 1, 1, 9, 6] if order == "decode_first" else [1, 9, 1, 6, 1]
    seq_lens = [21, 40, 7, 9, 30] if order == "decode_first" else [21, 9, 40, 30, 7]
    storage = _storage(2, 16, 4, 60, 2)
    k_cache, v_cache = storage.layer_view(0)
    tables = _batch(rng, seq_lens, 4, 60, False)
    meta = AttentionMetadata.build(tables, seq_lens, q_lens, 4, null_block=storage.null_block_id)
    meta.workspace = attn_torch.Workspace(mirror=False, kernel=True)
    T = sum(q_lens)
    gen = torch.Generator().manual_seed(3)
    q, key, value = (torch.randn(T, h, 16, generator=gen) for h in (4, 2, 2))
    out = attn_torch.forward(q, key, value, k_cache, v_cache, meta, 0.25, layer=0)
    assert meta.torch_plan.kernel is not None and not meta.torch_plan.decode
    assert isinstance(meta.torch_plan.kernel.rows, slice) == (order == "decode_first")
    row = 0
    for table, n, count in zip(tables, seq_lens, q_lens):
        for i in range(count):  # each new token over its keys up to its own position
            ref = _reference(q[row + i:row + i + 1], k_cache, v_cache, [table], [n - count + i + 1], 0.25)
            torch.testing.assert_close(out[row + i].double(), ref[0], atol=2e-6, rtol=2e-5)
        row += count


def test_refusals():
    storage = _storage(2, 32, 4, 8, 0)
    k_cache, v_cache = storage.layer_view(0)
    batch = cpu_attention.DecodeBatch.build([[0, 1]], [6], 4)
    q = torch.randn(1, 4, 32)
    with pytest.raises(ValueError, match="length 9 outside 1..8"):
        cpu_attention.DecodeBatch.build([[0, 1]], [9], 4)
    with pytest.raises(ValueError, match="length 0"):
        cpu_attention.DecodeBatch.build([[0]], [0], 4)
    with pytest.raises(ValueError, match="negative block id"):
        cpu_attention.DecodeBatch.build([[-1]], [2], 4)
    with pytest.raises(TypeError, match="float32"):
        cpu_attention.paged_decode(q.double(), k_cache, v_cache, batch, 1.0)
    with pytest.raises(ValueError, match="does not fit"):  # block 40 is not in a pool of 9
        cpu_attention.paged_decode(q, k_cache, v_cache, cpu_attention.DecodeBatch.build([[40]], [2], 4), 1.0)
    with pytest.raises(ValueError, match="does not fit"):  # blocks of 8 against a pool of 4
        cpu_attention.paged_decode(q, k_cache, v_cache, cpu_attention.DecodeBatch.build([[0]], [2], 8), 1.0)
    with pytest.raises(ValueError, match="do not group"):
        cpu_attention.paged_decode(torch.randn(1, 3, 32), k_cache, v_cache, batch, 1.0)
    odd = _storage(1, 24, 4, 4, 0).layer_view(0)
    with pytest.raises(ValueError, match="head size 24"):
        cpu_attention.paged_decode(torch.randn(1, 1, 24), *odd, batch, 1.0)
    with pytest.raises(ValueError, match="contiguous float32"):
        cpu_attention.paged_decode(q, k_cache, v_cache, batch, 1.0, out=torch.empty(1, 32, 4).transpose(1, 2))


def test_without_a_compiler_the_engine_uses_the_mirror(monkeypatch, tmp_path, caplog):
    from engine.engine import EngineConfig, LLMEngine
    from engine.sampling import SamplingParams

    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    cpu_kernels.load.cache_clear()
    try:
        assert not cpu_attention.available()
        assert "CPU kernel paged_decode unavailable" in caplog.text
        eng = LLMEngine(EngineConfig(model="tiny", num_blocks=64, num_host_blocks=0))
        assert not eng.workspace.kernel and eng.workspace.mirror is not None
        without = eng.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=6, ignore_eos=True))
    finally:
        monkeypatch.undo()
        cpu_kernels.load.cache_clear()
    eng = LLMEngine(EngineConfig(model="tiny", num_blocks=64, num_host_blocks=0))
    assert eng.workspace.kernel and eng.workspace.mirror is None
    with_kernel = eng.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert with_kernel[0].choices[0]["token_ids"] == without[0].choices[0]["token_ids"]


def test_decode_benchmark_runs_every_path_on_the_same_steps():
    """`pdserve bench decode`'s case runner on a small case: each path timed on as many steps."""
    from bench.cpu_decode import PATHS, run_case

    r = run_case(("small", 4, 2, 16, 2, 3, 5, 40), steps=2, rounds=1)
    assert set(r["us_per_layer_step"]) == set(PATHS) and r["steps_per_path"] == 2
    assert all(t > 0 for t in r["us_per_layer_step"].values()) and r["kernel_kv_gbytes_per_s"] > 0
