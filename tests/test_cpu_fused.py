"""The compiled elementwise kernels (engine.cpu_fused) against the torch ops they replace.

Rotary and the K/V store must give the same bits as torch (the kernels round as torch does);
RMSNorm and SiLU * up agree within float32 rounding (their sums and exponentials are their own),
over shapes whose widths are and are not multiples of the kernels' 16-float vectors, strided
views included; the residual add happens in place. Then extreme inputs and every refusal.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import cpu_fused
from engine.rope import apply_rotary

pytestmark = pytest.mark.skipif(not cpu_fused.available(), reason="no C compiler for the kernels")


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), dim=st.sampled_from([8, 16, 24, 64, 128, 576]), seed=st.integers(0, 999),
       residual=st.booleans(), pad=st.integers(0, 5))
def test_rms_norm_matches_torch(rows, dim, seed, residual, pad):
    wide = _randn(rows, dim + pad, seed=seed, scale=3.0)
    x = wide[:, :dim]  # strided rows when pad > 0
    w = _randn(dim, seed=seed + 1)
    h = _randn(rows, dim, seed=seed + 2) if residual else None
    expect_h = None if h is None else h + x
    out = cpu_fused.rms_norm(x, w, 1e-5, h)
    ref = F.rms_norm(x if h is None else expect_h, (dim,), w, 1e-5)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    if h is not None:
        assert torch.equal(h, expect_h)  # added in place, the same float32 sum


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 20), heads=st.integers(1, 12), dim=st.sampled_from([8, 16, 32, 64, 128]),
       seed=st.integers(0, 999))
def test_rotary_is_bit_exact(rows, heads, dim, seed):
    qkv = _randn(rows, heads + 2, dim, seed=seed, scale=2.0)  # rotate the first `heads` heads, as the model
    cos, sin = _randn(rows, 1, dim, seed=seed + 1), _randn(rows, 1, dim, seed=seed + 2)
    ref = apply_rotary(qkv[:, :heads], cos, sin)
    untouched = qkv[:, heads:].clone()
    out = cpu_fused.rotary_(qkv[:, :heads], cos, sin)
    assert out.data_ptr() == qkv.data_ptr() and torch.equal(out, ref)
    assert torch.equal(qkv[:, heads:], untouched)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 20), inter=st.sampled_from([8, 16, 40, 352, 1536]), seed=st.integers(0, 999),
       scale=st.sampled_from([1.0, 10.0, 100.0]))
def test_silu_mul_matches_torch(rows, inter, seed, scale):
    gate_up = _randn(rows, 2 * inter, seed=seed, scale=scale)
    ref = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    out = cpu_fused.silu_mul(gate_up)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


def test_store_kv_equals_index_put_and_refuses_outside_slots():
    qkv = _randn(6, 8, 16, seed=4)  # (T, Hq 4 + Hkv 2 + Hkv 2, D)
    key, value = qkv[:, 4:6], qkv[:, 6:]
    pool = torch.zeros(9, 2, 2, 4, 2, 16)  # (N, layers, K/V, B, Hkv, D), like KVStorage
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    blocks, offsets = torch.tensor([3, 3, 0, 8, 5, 3]), torch.tensor([0, 1, 3, 2, 0, 3])
    ref = pool.clone()
    ref[:, 1, 0].index_put_((blocks, offsets), key)
    ref[:, 1, 1].index_put_((blocks, offsets), value)
    cpu_fused.store_kv(key, value, k_cache, v_cache, blocks, offsets)
    assert torch.equal(pool, ref)
    before = pool.clone()
    with pytest.raises(ValueError, match="outside the pool"):
        cpu_fused.store_kv(key, value, k_cache, v_cache, torch.tensor([3, 3, 0, 9, 5, 3]), offsets)
    with pytest.raises(ValueError, match="outside the pool"):
        cpu_fused.store_kv(key, value, k_cache, v_cache, blocks, torch.tensor([0, 1, 3, 4, 0, 3]))
    assert torch.equal(pool, before)  # nothing written by a refused call


def test_refusals():
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="float32 CPU rows"):
        cpu_fused.rms_norm(x.double(), torch.ones(16), 1e-5)
    with pytest.raises(ValueError, match="float32 CPU rows"):
        cpu_fused.rms_norm(x.t(), torch.ones(4), 1e-5)  # columns not contiguous
    with pytest.raises(ValueError, match="residual"):
        cpu_fused.rms_norm(x, torch.ones(16), 1e-5, torch.zeros(4, 8))
    with pytest.raises(ValueError, match="contiguous heads"):
        cpu_fused.rotary_(torch.randn(2, 16, 3).transpose(1, 2), torch.ones(2, 16), torch.ones(2, 16))
    with pytest.raises(ValueError, match="D even"):
        cpu_fused.rotary_(torch.randn(2, 3, 7), torch.ones(2, 7), torch.ones(2, 7))
    with pytest.raises(ValueError, match="cos and sin"):
        cpu_fused.rotary_(torch.randn(2, 3, 8), torch.ones(3, 8), torch.ones(3, 8))
    with pytest.raises(ValueError, match="silu_mul"):
        cpu_fused.silu_mul(torch.randn(2, 7))
    caches, slots = (torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16)), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="one stride"):  # value rows further apart than key rows
        cpu_fused.store_kv(torch.randn(2, 2, 16), torch.randn(2, 4, 16)[:, :2], *caches, slots, slots)
    with pytest.raises(ValueError, match="int64"):
        cpu_fused.store_kv(torch.randn(2, 2, 16), torch.randn(2, 2, 16), *caches, slots, slots.int())
