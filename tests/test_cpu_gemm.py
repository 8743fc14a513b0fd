"""engine.cpu_gemm: oneDNN projections on packed weights are float32-exact up to summation order
(as close to a float64 reference as F.linear is) for any row count, bias, batch shape and strided
input; `pack` declines what it does not apply to; Projection switches paths; the loader packs
SmolLM2-sized weights and leaves the tiny model on F.linear. The greedy-equality oracle with packed
weights is test_model_hf.py (onednn cases) and test_gguf.py (SmolLM2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.cpu_gemm import MIN_PACKED_ELEMENTS, PackedLinear, Projection, available, pack

pytestmark = pytest.mark.skipif(not available(), reason="this torch has no oneDNN linear ops")


def _errors(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple[float, float]:
    """(oneDNN's, F.linear's) largest error against float64."""
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = PackedLinear(w, b)(x)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    return (got.double() - ref).abs().max().item(), (F.linear(x, w, b).double() - ref).abs().max().item()


@pytest.mark.parametrize("rows", [1, 5, 32, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_is_as_exact_as_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(384, 320, generator=gen)
    b = torch.randn(384, generator=gen) if bias else None
    ours, torch_ = _errors(torch.randn(rows, 320, generator=gen), w, b)
    # bfloat16 or TF32-style arithmetic would be ~1e-1 off here; float32 summed in another order is
    # 1e-5..1e-4 (oneDNN's blocking, and so its order, depends on the threads this process was given)
    assert ours <= 4 * torch_ + 1e-4, (ours, torch_)


def test_batched_and_strided_inputs():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(256, 96, generator=gen)
    packed = PackedLinear(w, None)
    x3 = torch.randn(3, 7, 96, generator=gen)
    torch.testing.assert_close(packed(x3), F.linear(x3, w), rtol=1e-5, atol=1e-4)
    strided = torch.randn(9, 2 * 96, generator=gen)[:, ::2]  # every other column
    assert not strided.is_contiguous()
    torch.testing.assert_close(packed(strided), F.linear(strided, w), rtol=1e-5, atol=1e-4)


def test_pack_declines_what_it_does_not_apply_to():
    big = torch.randn(512, 256)
    assert big.numel() >= MIN_PACKED_ELEMENTS and isinstance(pack(big), PackedLinear)
    assert pack(big.bfloat16()) is None
    assert pack(torch.empty(512, 256, device="meta")) is None
    small = torch.randn(64, 64)
    assert pack(small) is None  # oneDNN's dearer call does not pay below the threshold
    assert isinstance(pack(small, min_elements=0), PackedLinear)


def test_projection_switches_between_paths():
    proj = Projection(48, 80, bias=True)
    x = torch.randn(6, 48)
    with torch.inference_mode():
        plain = proj.forward(x)
        proj.pack_cpu(True, min_elements=0)
        assert proj.packed is not None
        torch.testing.assert_close(proj.forward(x), plain, rtol=1e-5, atol=1e-5)
        proj.pack_cpu(False)
        assert proj.packed is None
        assert torch.equal(proj.forward(x), F.linear(x, proj.weight, proj.bias))


def test_loader_packs_only_weights_that_pay():
    from engine.loader import load_model

    tiny, _, _ = load_model("tiny", backend="torch")  # every weight below the threshold
    assert all(getattr(m, "packed", None) is None for m in tiny.modules()) and tiny.logits_packed is None
    off, _, _ = load_model("tiny", backend="torch", cpu_gemm=False)
    off.pack_cpu_gemm(True, min_elements=0)
    layer = off.layers[0]
    assert layer.self_attn.qkv_proj.packed is not None and layer.mlp.gate_up_proj.packed is not None
    assert off.logits_packed is not None
    off.pack_cpu_gemm(False)
    assert layer.mlp.down_proj.packed is None and off.logits_packed is None
