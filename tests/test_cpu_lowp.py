"""The bf16/int8 gemv kernel (engine.cpu_lowp) against a float64 reference, then the weight formats
(engine.weight_format) on the tiny model: the kernel's decode rows agree with the float32 path on
the rounded weights, `f32` changes nothing, and every refusal. Shapes cover tails of both tiles
(rows not a multiple of 4, x rows not a multiple of 2, K not a multiple of 8 or 16), strided rows,
a bias, and the `where machine` record the benches write.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import cpu_lowp, weight_format

pytestmark = pytest.mark.skipif(not cpu_lowp.available(), reason="no C compiler for the kernels")


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _bound(x, w_f32):
    """float32 summation error bound for x (M, K) @ w (N, K)^T: K ulps of the absolute sum."""
    return (x.double().abs() @ w_f32.double().abs().T) * x.shape[1] * 2.0 ** -23 + 1e-30


@settings(max_examples=40, deadline=None)
@given(M=st.integers(1, 9), N=st.integers(1, 37), K=st.integers(1, 80), pad=st.integers(0, 3),
       fmt=st.sampled_from(["bf16", "int8"]), bias=st.booleans(), seed=st.integers(0, 999),
       threads=st.sampled_from([1, 2]))
def test_gemv_matches_float64_reference(M, N, K, pad, fmt, bias, seed, threads):
    x = _randn(M, K + pad, seed=seed)[:, :K]  # strided rows when pad > 0
    w = _randn(N, K, seed=seed + 1)
    b = _randn(N, seed=seed + 2) if bias else None
    stored, scale = weight_format.FORMATS[fmt](w)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = cpu_lowp.gemv_bf16(x, stored, b) if fmt == "bf16" else cpu_lowp.gemv_int8(x, stored, scale, b)
    finally:
        torch.set_num_threads(old)
    ref = cpu_lowp.reference(x, stored, scale, b)  # (M, N) float64
    assert y.shape == (M, N) and y.dtype == torch.float32
    deq = cpu_lowp.dequantize(stored, scale)
    assert ((y.double() - ref).abs() <= _bound(x, deq) + ref.abs() * 2.0 ** -23).all()


def test_quantizers_round_as_documented():
    w = _randn(6, 40, seed=3)
    w[2] = 0.0  # an all-zero row: scale 1, values 0
    b, none = cpu_lowp.quantize_bf16(w)
    assert none is None and torch.equal(b, w.to(torch.bfloat16))
    q, s = cpu_lowp.quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (6,) and s[2] == 1.0 and (q[2] == 0).all()
    assert q.abs().max() == 127
    deq = cpu_lowp.dequantize(q, s)
    assert ((deq - w).abs() <= s[:, None] / 2 + 1e-7).all()  # within half a step per row


def test_refusals():
    x, w = torch.zeros(2, 8), torch.zeros(3, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError):
        cpu_lowp.gemv_bf16(x.double(), w)
    with pytest.raises(TypeError):
        cpu_lowp.gemv_bf16(x, w.float())
    with pytest.raises(ValueError):
        cpu_lowp.gemv_bf16(torch.zeros(2, 7), w)
    with pytest.raises(ValueError):
        cpu_lowp.gemv_bf16(torch.zeros(8, 2).T, w)  # columns not contiguous
    with pytest.raises(ValueError):
        cpu_lowp.gemv_bf16(x, w, bias=torch.zeros(4))
    q = torch.zeros(3, 8, dtype=torch.int8)
    with pytest.raises(ValueError):
        cpu_lowp.gemv_int8(x, q, None)
    with pytest.raises(ValueError):
        cpu_lowp.gemv_int8(x, q, torch.ones(2))
    with pytest.raises(ValueError):
        cpu_lowp.LowpLinear(q, None, None)
    with pytest.raises(ValueError):
        weight_format.check_name("q4")
    assert cpu_lowp.gemv_bf16(torch.zeros(0, 8), w).shape == (0, 3)


def _tiny(weights):
    from engine.loader import load_model

    return load_model("tiny", backend="torch", weights=weights)[0]


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_formats_on_the_tiny_model(fmt):
    from engine.cpu_gemm import Projection

    f32, model = _tiny("f32"), _tiny(fmt)
    projections = [m for m in model.modules() if isinstance(m, Projection)]
    assert all(m.lowp is not None for m in projections) and model.logits_lowp is not None
    assert all(getattr(m, "lowp", None) is None for m in f32.modules() if isinstance(m, Projection))
    # the float32 parameters hold the rounded weights; the kernel's rows agree with them
    w = model.embed_tokens.weight
    stored, scale = weight_format.FORMATS[fmt](f32.embed_tokens.weight)
    assert torch.equal(w, cpu_lowp.dequantize(stored, scale))
    h = _randn(3, w.shape[1], seed=5)
    torch.testing.assert_close(model.compute_logits(h), h @ w.T, atol=1e-5, rtol=1e-5)
    many = _randn(cpu_lowp.MAX_ROWS + 3, w.shape[1], seed=6)  # past max_rows: the float32 path
    torch.testing.assert_close(model.compute_logits(many), many @ w.T, atol=1e-5, rtol=1e-5)
    full = weight_format.decode_weight_bytes(f32)
    assert weight_format.decode_weight_bytes(model) < full / (1.9 if fmt == "bf16" else 3.5)


def test_greedy_on_the_tiny_model_through_the_engine():
    from engine.engine import EngineConfig, LLMEngine
    from engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = {}
    for fmt in ("f32", "bf16"):
        eng = LLMEngine(EngineConfig(weights=fmt, num_blocks=64, num_host_blocks=0))
        outs[fmt] = [c.choices[0]["token_ids"] for c in eng.generate([[256, 72, 105], [256, 65]], params)]
    assert all(len(o) == 12 for o in outs["bf16"])
    with pytest.raises(ValueError):
        EngineConfig(weights="fp4")


def test_machine_record():
    from measure import machine

    d = machine.describe()
    assert d["memory_copy_gb_per_s"] > 0
    assert {"model", "family", "flags"} <= set(d["cpu"]) and d["cores"]["logical"] >= 1
    assert d["threads"]["torch"] >= 1 and d["kernels"]["lowp_gemv"] is True
    assert "GB/s" in machine.summary(d)


def test_machine_record_names_the_instruction_sets_it_was_held_to(monkeypatch):
    from measure import machine

    monkeypatch.delenv("PDSERVE_KERNEL_MARCH", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    d = machine.describe(bandwidth=False)
    assert d["isa"]["kernel_march"] == "native" and d["isa"]["torch_cpu_capability"]
    assert d["isa"]["overrides"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert "held to ONEDNN_MAX_CPU_ISA=AVX2" in machine.summary(d)
