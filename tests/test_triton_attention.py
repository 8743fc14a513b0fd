"""Triton paged-attention kernels (engine.attn_triton) against the torch reference (engine.attn_torch).

CPU tier: the kernels run under TRITON_INTERPRET=1 on tiny shapes drawn at random (ragged
lengths, GQA 1/2/4/8, cache blocks of 1/16/32, head dims 64/128, prefill with and without a
cached prefix, decode with and without a split context), on real KVStorage pools whose layer
views are strided. GPU tier (`gpu` marker): real shapes in float16/bfloat16.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402

from engine import attn_torch, attn_triton  # noqa: E402
from engine.attention import get_backend  # noqa: E402
from engine.attn_metadata import AttentionMetadata  # noqa: E402
from kvcache.storage import KVLayout, KVStorage  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=3e-3, rtol=1e-2),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# The GPU tier times nothing but runs real shapes: under the interpreter that would take hours.
COMPILED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                              reason="GPU tier needs compiled kernels (unset TRITON_INTERPRET)")
DTYPE_NAME = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _pool(block_size, kv_heads, head_dim, num_blocks, dtype=torch.float32, seed=0):
    """A 2-layer pool full of random values (garbage outside the live slots); layer 1's views."""
    storage = KVStorage(KVLayout(2, kv_heads, head_dim, block_size, DTYPE_NAME[dtype]), num_blocks, DEV)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    storage.data.copy_(torch.randn(storage.data.shape, generator=gen, device=DEV))
    k_cache, v_cache = storage.layer_view(1)
    assert not k_cache.is_contiguous()
    return storage, k_cache, v_cache


def _tables(gen, seq_lens, block_size, num_blocks):
    """Random distinct physical blocks for each sequence."""
    need = [-(-n // block_size) for n in seq_lens]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    assert sum(need) <= num_blocks
    out, at = [], 0
    for k in need:
        out.append(perm[at:at + k])
        at += k
    return out


def _run_prefill(seq_lens, query_lens, block_size, group, head_dim, dtype=torch.float32, seed=0,
                 kv_heads=None):
    """store_kv then attention on one batch, Triton and reference on separate copies of the pool."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads = kv_heads or (2 if group <= 2 else 1)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    storage, k_cache, v_cache = _pool(block_size, kv_heads, head_dim, num_blocks, dtype, seed)
    ref_storage = KVStorage(storage.layout, num_blocks, DEV)
    ref_storage.data.copy_(storage.data)
    rk, rv = ref_storage.layer_view(1)
    meta = AttentionMetadata.build(_tables(gen, seq_lens, block_size, num_blocks), seq_lens, query_lens,
                                   block_size, DEV)
    T, Hq = sum(query_lens), kv_heads * group
    # q, k, v as views of one fused projection, like a model's qkv split: non-contiguous inputs.
    qkv = torch.randn(T, Hq + 2 * kv_heads, head_dim, generator=gen).to(DEV, dtype)
    q, key, value = qkv.split([Hq, kv_heads, kv_heads], dim=1)  # (T, H*, D) each
    attn_triton.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    attn_torch.store_kv(key, value, rk, rv, meta.slot_mapping)
    assert torch.equal(storage.data, ref_storage.data)
    scale = head_dim ** -0.5
    out = attn_triton.paged_attention(q, k_cache, v_cache, meta, scale)
    ref = attn_torch.paged_attention(q, rk, rv, meta, scale)
    return out, ref


@pytest.mark.parametrize("block_size,group,head_dim,with_prefix", [
    (16, 1, 64, False),
    (16, 2, 128, True),
    (32, 4, 64, True),
    (1, 8, 64, True),
    (1, 2, 128, False),
    (32, 8, 128, False),
])
def test_prefill_matches_reference(block_size, group, head_dim, with_prefix):
    gen = torch.Generator().manual_seed(block_size * 100 + group * 10 + head_dim)
    query_lens = torch.randint(1, 24, (3,), generator=gen).tolist()
    query_lens[0] = 19  # at least one sequence spans two query tiles
    prefix = torch.randint(1, 40, (3,), generator=gen).tolist() if with_prefix else [0, 0, 0]
    seq_lens = [p + q for p, q in zip(prefix, query_lens)]
    out, ref = _run_prefill(seq_lens, query_lens, block_size, group, head_dim, seed=group)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_prefill_mixed_with_decode_rows():
    """A batch mixing one-token sequences with longer prefills goes through the prefill kernel."""
    out, ref = _run_prefill([33, 7, 18], [1, 7, 5], 16, 2, 64, seed=3)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def _decode_case(seq_lens, block_size, group, head_dim, dtype=torch.float32, seed=0, kv_heads=None):
    gen = torch.Generator().manual_seed(seed)
    kv_heads = kv_heads or (2 if group <= 2 else 1)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    _, k_cache, v_cache = _pool(block_size, kv_heads, head_dim, num_blocks, dtype, seed)
    meta = AttentionMetadata.build(_tables(gen, seq_lens, block_size, num_blocks), seq_lens,
                                   [1] * len(seq_lens), block_size, DEV)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=gen).to(DEV, dtype)
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("block_size,group,head_dim,num_splits", [
    (16, 1, 64, None),
    (16, 2, 128, 3),
    (32, 4, 64, None),
    (1, 8, 128, 2),
    (1, 4, 64, 4),
    (32, 8, 64, None),
])
def test_decode_matches_reference(block_size, group, head_dim, num_splits):
    gen = torch.Generator().manual_seed(block_size + group + head_dim)
    seq_lens = torch.randint(1, 70, (4,), generator=gen).tolist()
    seq_lens[0] = 1  # a first token: one key, and empty splits when the context is split
    q, k_cache, v_cache, meta = _decode_case(seq_lens, block_size, group, head_dim, seed=group)
    scale = head_dim ** -0.5
    if num_splits is None:
        out = attn_triton.paged_attention(q, k_cache, v_cache, meta, scale)
    else:
        out = attn_triton.paged_decode(q, k_cache, v_cache, meta, scale, num_splits=num_splits)
    ref = attn_torch.paged_attention(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("seed", [101, 202, 303])
def test_random_configurations(seed):
    """A few configurations drawn at random (group, block size, head dim, lengths, prefix)."""
    gen = torch.Generator().manual_seed(seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=gen))]  # noqa: E731
    group, block_size, head_dim = pick([1, 2, 4, 8]), pick([1, 16, 32]), pick([64, 128])
    query_lens = torch.randint(1, 20, (2,), generator=gen).tolist()
    seq_lens = [q + int(torch.randint(0, 30, (1,), generator=gen)) for q in query_lens]
    out, ref = _run_prefill(seq_lens, query_lens, block_size, group, head_dim, seed=seed)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    q, k_cache, v_cache, meta = _decode_case(seq_lens, block_size, group, head_dim, seed=seed)
    out = attn_triton.paged_decode(q, k_cache, v_cache, meta, 0.1, num_splits=pick([1, 2]))
    torch.testing.assert_close(out, attn_torch.paged_attention(q, k_cache, v_cache, meta, 0.1),
                               **TOL[torch.float32])


def test_float16_prefill_and_decode():
    out, ref = _run_prefill([20, 9], [12, 9], 16, 4, 64, dtype=torch.float16, seed=5)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, ref, **TOL[torch.float16])
    q, k_cache, v_cache, meta = _decode_case([37, 5], 16, 2, 64, dtype=torch.float16, seed=6)
    out = attn_triton.paged_attention(q, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(out, attn_torch.paged_attention(q, k_cache, v_cache, meta, 0.125),
                               **TOL[torch.float16])


def test_block_size_1_and_16_give_identical_outputs():
    """The same logical K/V laid out in a B=1 pool and a B=16 pool: bit-identical attention."""
    gen = torch.Generator().manual_seed(11)
    seq_lens, query_lens, Hkv, Hq, D = [29, 40], [13, 6], 2, 4, 64
    keys = [torch.randn(n, Hkv, D, generator=gen) for n in seq_lens]  # (n, Hkv, D) per sequence
    values = [torch.randn(n, Hkv, D, generator=gen) for n in seq_lens]
    q = torch.randn(sum(query_lens), Hq, D, generator=gen).to(DEV)
    outs = []
    for block_size in (1, 16):
        num_blocks = sum(-(-n // block_size) for n in seq_lens) + 4
        _, k_cache, v_cache = _pool(block_size, Hkv, D, num_blocks, seed=block_size)
        tables = _tables(gen, seq_lens, block_size, num_blocks)
        full = AttentionMetadata.build(tables, seq_lens, seq_lens, block_size, DEV)  # every position's slot
        attn_triton.store_kv(torch.cat(keys).to(DEV), torch.cat(values).to(DEV), k_cache, v_cache,
                             full.slot_mapping)
        prefill = AttentionMetadata.build(tables, seq_lens, query_lens, block_size, DEV)
        decode = AttentionMetadata.build(tables, seq_lens, [1, 1], block_size, DEV)
        outs.append((attn_triton.paged_attention(q, k_cache, v_cache, prefill, D ** -0.5),
                     attn_triton.paged_attention(q[:2], k_cache, v_cache, decode, D ** -0.5),
                     attn_triton.paged_decode(q[:2], k_cache, v_cache, decode, D ** -0.5, num_splits=2)))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    ref = attn_torch.paged_attention(q[:2], k_cache, v_cache, decode, D ** -0.5)
    torch.testing.assert_close(outs[1][1], ref, **TOL[torch.float32])


def test_store_kv_writes_exactly_the_given_slots():
    storage, k_cache, v_cache = _pool(16, 2, 32, 6)
    before = storage.data.clone()
    gen = torch.Generator().manual_seed(2)
    slots = torch.tensor([0, 17, 95, 40, -1, 63], dtype=torch.int64, device=DEV)  # -1: padding, skipped
    key = torch.randn(6, 2, 32, generator=gen).to(DEV)
    value = torch.randn(6, 2, 32, generator=gen).to(DEV)
    attn_triton.store_kv(key, value, k_cache, v_cache, slots)
    expect = before.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expect[slot // 16, 1, 0, slot % 16] = key[t]
            expect[slot // 16, 1, 1, slot % 16] = value[t]
    assert torch.equal(storage.data, expect)
    assert not torch.equal(storage.data, before)


def test_store_kv_casts_to_the_cache_dtype():
    storage, k_cache, v_cache = _pool(4, 1, 16, 3, dtype=torch.float16)
    key = torch.randn(2, 1, 16, device=DEV)
    value = torch.randn(2, 1, 16, device=DEV)
    attn_triton.store_kv(key, value, k_cache, v_cache, torch.tensor([5, 2], device=DEV))
    assert torch.equal(k_cache[1, 1], key[0].half()) and torch.equal(v_cache[0, 2], value[1].half())


def _bad_inputs():
    _, k, v = _pool(16, 2, 64, 4)
    meta = AttentionMetadata.build([[0, 1]], [20], [4], 16, DEV)
    q = torch.randn(4, 4, 64, device=DEV)
    _, k48, v48 = _pool(16, 2, 48, 4)
    kv = torch.randn(4, 2, 64, device=DEV)
    return {
        "head_dim not a power of two": lambda: attn_triton.paged_attention(
            torch.randn(4, 4, 48, device=DEV), k48, v48, meta, 0.1),
        "q dtype differs from cache": lambda: attn_triton.paged_attention(q.double(), k, v, meta, 0.1),
        "q heads not a multiple": lambda: attn_triton.paged_attention(q[:, :3], k, v, meta, 0.1),
        "q head_dim mismatch": lambda: attn_triton.paged_attention(q[..., :32], k, v, meta, 0.1),
        "token count mismatch": lambda: attn_triton.paged_attention(q[:3], k, v, meta, 0.1),
        "k and v caches differ": lambda: attn_triton.paged_attention(q, k, v[:2], meta, 0.1),
        "integer cache": lambda: attn_triton.store_kv(kv, kv, k.int(), v.int(), meta.slot_mapping),
        "key shape": lambda: attn_triton.store_kv(kv[:, :1], kv[:, :1], k, v, meta.slot_mapping),
        "slot count": lambda: attn_triton.store_kv(kv, kv, k, v, meta.slot_mapping[:3]),
        "float slots": lambda: attn_triton.store_kv(kv, kv, k, v, meta.slot_mapping.float()),
        "bad tile": lambda: attn_triton.paged_decode(q[:1], k, v, AttentionMetadata.build(
            [[0, 1]], [20], [1], 16, DEV), 0.1, block_n=24),
    }


@pytest.mark.parametrize("case", sorted(_bad_inputs()))
def test_launchers_refuse_bad_input(case):
    with pytest.raises(ValueError):
        _bad_inputs()[case]()


def test_cpu_tensors_refused_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _, k, v = _pool(16, 1, 16, 2)
    with pytest.raises(ValueError, match="CUDA"):
        attn_triton.store_kv(torch.zeros(1, 1, 16), torch.zeros(1, 1, 16), k.cpu(), v.cpu(),
                             torch.zeros(1, dtype=torch.int64))


def test_backend_selection(monkeypatch):
    assert get_backend("triton").paged_attention is attn_triton.paged_attention
    monkeypatch.setenv("PDSERVE_ATTENTION", "triton")
    backend = get_backend(None, "cpu")
    assert backend.name == "triton" and backend.store_kv is attn_triton.store_kv
    monkeypatch.delenv("PDSERVE_ATTENTION")
    assert get_backend(None, "cpu").name == "torch"


@pytest.mark.gpu
@COMPILED
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_decode_real_shapes(dtype):
    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(1, 2049, (64,), generator=gen).tolist()
    seq_lens[0] = 2048
    q, k_cache, v_cache, meta = _decode_case(seq_lens, 16, 4, 128, dtype=dtype, kv_heads=8)  # Hq 32
    ref = attn_torch.paged_attention(q, k_cache, v_cache, meta, 128 ** -0.5)
    torch.testing.assert_close(attn_triton.paged_attention(q, k_cache, v_cache, meta, 128 ** -0.5), ref,
                               **TOL[dtype])
    for splits in (1, 7):
        out = attn_triton.paged_decode(q, k_cache, v_cache, meta, 128 ** -0.5, num_splits=splits)
        torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.gpu
@COMPILED
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_prefill_real_shapes(dtype, block_size):
    gen = torch.Generator().manual_seed(1)
    query_lens = torch.randint(1, 1025, (8,), generator=gen).tolist()
    prefix = torch.randint(0, 1025, (8,), generator=gen).tolist()
    prefix[0] = 0
    seq_lens = [p + q for p, q in zip(prefix, query_lens)]
    out, ref = _run_prefill(seq_lens, query_lens, block_size, 4, 128, dtype=dtype, kv_heads=8)  # Hq 32
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA run is the real benchmark, not a test")
def test_bench_kernels_cpu_smoke(tmp_path, capsys):
    """Without CUDA `pdserve bench kernels` runs one tiny interpreter case per kernel and exits 0."""
    import json

    from pdserve_cli.main import main
    assert main(["bench", "kernels", "--json", str(tmp_path / "k.json")]) == 0
    body = json.loads((tmp_path / "k.json").read_text())
    assert [r["kernel"] for r in body["results"]] == ["store_kv", "decode", "prefill"]
    assert all(r["max_abs_err"] < 1e-5 and r["triton_ms"] > 0 for r in body["results"])
    assert "no CUDA" in body["note"]
