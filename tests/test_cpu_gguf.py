"""The GGUF block gemv kernel (engine.cpu_gguf) and `--weights gguf` (engine.weight_format).

The kernel against a float64 reference on random Q4_1 / Q8_0 blocks (x rows 1..6, row counts
not a multiple of the tiles, several blocks per row, strided x and out, a bias, 1 and 2
threads), its widened weights bit for bit the gguf package's dequantized values, the same
source built for plain x86-64 and for AVX2 without AVX-512, and every refusal. Then the format:
on the tiny model with synthetic blocks (kept types get a GgufLinear, others and mixed fused
projections fall back to bf16), refused without a GGUF file, and on the shipped SmolLM2 (greedy
tokens as f32's, the same model identity, 5x fewer bytes per decode step).
"""

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from hypothesis import given, settings
from hypothesis import strategies as st
from smollm2_helpers import SKIP, engine_model

from engine import cpu_gguf, cpu_kernels, cpu_lowp, weight_format

pytestmark = pytest.mark.skipif(not cpu_gguf.available(), reason="no C compiler for the kernels")


def random_blocks(qtype: str, N: int, nb: int, seed: int) -> torch.Tensor:
    """uint8 (N, nb * bytes per block): random codes, finite f16 scales (and Q4_1 minimums)."""
    rng = np.random.default_rng(seed)
    d = (rng.standard_normal((N, nb, 1)) * 0.05).astype(np.float16).view(np.uint8)  # (N, nb, 2)
    if qtype == "Q4_1":
        m = (rng.standard_normal((N, nb, 1)) * 0.4).astype(np.float16).view(np.uint8)
        parts = [d, m, rng.integers(0, 256, (N, nb, 16), dtype=np.uint8)]
    else:
        parts = [d, rng.integers(-128, 128, (N, nb, 32), dtype=np.int8).view(np.uint8)]
    return torch.from_numpy(np.concatenate(parts, axis=-1).reshape(N, -1))


def special_scales(w: torch.Tensor) -> torch.Tensor:
    """w with its first blocks' f16 scales (and Q4_1 minimums) set to subnormals, -0 and 0."""
    w = w.clone()
    values = np.array([3e-6, -6e-8, -0.0, 0.0, 1e-5], dtype=np.float16).view(np.uint8).reshape(-1, 2)
    for row, v in zip(range(w.shape[0]), values):
        w[row, 0:2] = torch.from_numpy(v.copy())
        w[row, 2:4] = torch.from_numpy(v.copy())  # Q4_1: m; Q8_0: the first two codes
    return w


def _bound(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """float32 summation error bound for x (M, K) @ w (N, K)^T: K ulps of the absolute sum."""
    return (x.double().abs() @ w.double().abs().T) * x.shape[1] * 2.0 ** -23 + ref.abs() * 2.0 ** -23 + 1e-30


def _with_threads(threads, fn):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)


@settings(max_examples=60, deadline=None)
@given(qtype=st.sampled_from(sorted(cpu_gguf.TYPES)), M=st.integers(1, 6), N=st.integers(1, 37),
       nb=st.integers(1, 5), pad=st.integers(0, 3), out_pad=st.integers(0, 2), bias=st.booleans(),
       seed=st.integers(0, 999), threads=st.sampled_from([1, 2]))
def test_gemv_matches_float64_reference(qtype, M, N, nb, pad, out_pad, bias, seed, threads):
    K = nb * cpu_gguf.BLOCK
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K + pad, generator=g)[:, :K]  # strided rows when pad > 0
    w = random_blocks(qtype, N, nb, seed)
    b = torch.randn(N, generator=g) if bias else None
    out = torch.full((M, N + out_pad), float("nan"))[:, :N]  # strided out
    y = _with_threads(threads, lambda: cpu_gguf.gemv(x, w, qtype, b, out=out))
    assert y.data_ptr() == out.data_ptr() and y.dtype == torch.float32
    ref = cpu_gguf.reference(x, w, qtype, b)  # (M, N) float64
    deq = cpu_gguf.dequantize(w, qtype, torch.float64)
    assert ((y.double() - ref).abs() <= _bound(x, deq, ref)).all()
    assert torch.equal(cpu_gguf.GgufLinear(w, qtype, b)(x), _with_threads(
        threads, lambda: cpu_gguf.gemv(x.contiguous(), w, qtype, b)))


@pytest.mark.parametrize("qtype", sorted(cpu_gguf.TYPES))
def test_widened_weights_are_the_gguf_packages_values(qtype):
    """Unit rows of x pick single weights: the kernel's widened values equal, bit for bit, the
    gguf package's dequantization (random blocks and blocks it quantized itself)."""
    kind = GGMLQuantizationType[qtype]
    real = np.random.default_rng(1).standard_normal((13, 96)).astype(np.float32)
    own = torch.from_numpy(gguf_quantize(real, kind))
    for w in (special_scales(random_blocks(qtype, 13, 3, seed=7)), own):
        theirs = torch.from_numpy(np.ascontiguousarray(gguf_dequantize(w.numpy(), kind)))  # (13, 96)
        assert torch.equal(cpu_gguf.dequantize(w, qtype), theirs)
        for cols in ([0, 15, 16, 31], [32, 47, 48, 95]):  # low and high nibbles, later blocks
            e = torch.zeros(4, 96)
            e[range(4), cols] = 1.0
            assert torch.equal(cpu_gguf.gemv(e, w, qtype), theirs[:, cols].T)


@pytest.mark.parametrize("qtype", sorted(cpu_gguf.TYPES))
def test_pack_moves_each_byte_to_its_lane(qtype):
    """The f32 kernel's layout, byte by byte: group g, block column b, lane r is row 16 g + r; the
    rows' scales first, then their codes rows-innermost; a short last group padded with zeros."""
    N, nb, size = 21, 3, cpu_gguf.TYPES[qtype]
    w = random_blocks(qtype, N, nb, seed=3)
    packed = cpu_gguf.pack(w, qtype)
    assert packed.shape == (32, nb * size) and packed.is_contiguous()
    flat, scales = packed.reshape(-1), 4 if qtype == "Q4_1" else 2
    for row in (0, 7, 15, 16, 20):
        g, r = divmod(row, 16)
        for b in range(nb):
            block, at = w[row, b * size:(b + 1) * size], (g * nb + b) * 16 * size
            for s in range(0, scales, 2):  # d (and m): 16 halves per field
                assert torch.equal(flat[at + 16 * s + 2 * r:at + 16 * s + 2 * r + 2], block[s:s + 2])
            codes = flat[at + 16 * scales:at + 16 * size].view(-1, 16)  # (codes, 16 lanes)
            assert torch.equal(codes[:, r], block[scales:])
    for b in range(nb):  # rows 21..31 (lanes 5..15 of group 1): zero blocks, weights 0
        at = (nb + b) * 16 * size
        lanes = flat[at:at + 16 * size]
        for s in range(0, scales, 2):
            assert not lanes[16 * s + 2 * 5:16 * s + 32].any()
        assert not lanes[16 * scales:].view(-1, 16)[:, 5:].any()


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """march -> gguf_gemv.c built for it (not -march=native) with its signatures set, or None
    without a C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    where = tmp_path_factory.mktemp("gguf_gemv")

    def build(march: str):
        if cc is None:
            return None
        flags = [f for f in cpu_kernels.COMMON if f != "-march=native"] + [f"-march={march}"]
        out = where / f"gguf_gemv-{march}.so"
        source = str(cpu_kernels.CSRC / "gguf_gemv.c")
        subprocess.run([cc, *flags, *cpu_kernels.LIBRARIES["gguf_gemv"][0], source, "-o", str(out)],
                       check=True, capture_output=True, timeout=120)
        lib = ctypes.CDLL(str(out))
        for name, (args, result) in cpu_kernels.LIBRARIES["gguf_gemv"][1].items():
            getattr(lib, name).argtypes, getattr(lib, name).restype = args, result
        return lib

    return build


@pytest.mark.parametrize("march", ["x86-64", "haswell"])  # generic vectors; AVX2 + FMA + F16C only
def test_other_instruction_sets(march, build, monkeypatch):
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 builds")
    lib = build(march)
    if lib is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(cpu_gguf, "_lib", lambda act="f32": lib)
    for qtype in cpu_gguf.TYPES:
        for M, N, nb in ((1, 9, 3), (3, 6, 2), (4, 5, 1), (6, 37, 2)):  # 3 groups of rows, 2 chunks of x
            x = torch.randn(M, nb * 32, generator=torch.Generator().manual_seed(M))
            w = special_scales(random_blocks(qtype, N, nb, seed=N))
            y, ref = cpu_gguf.gemv(x, w, qtype), cpu_gguf.reference(x, w, qtype)
            assert ((y.double() - ref).abs() <= _bound(x, cpu_gguf.dequantize(w, qtype), ref)).all()
            e = torch.eye(nb * 32)[:M]
            assert torch.equal(cpu_gguf.gemv(e, w, qtype), cpu_gguf.dequantize(w, qtype)[:, :M].T)


def test_refusals():
    x, w = torch.zeros(2, 64), random_blocks("Q4_1", 3, 2, seed=0)
    with pytest.raises(TypeError):
        cpu_gguf.gemv(x.double(), w, "Q4_1")
    with pytest.raises(TypeError):
        cpu_gguf.gemv(x, w.to(torch.int8), "Q4_1")
    with pytest.raises(ValueError):
        cpu_gguf.gemv(x, w, "Q8_0")  # 40-byte rows are not two Q8_0 blocks
    with pytest.raises(ValueError):
        cpu_gguf.gemv(torch.zeros(2, 60), w[:, :38], "Q4_1")  # K not a multiple of 32
    with pytest.raises(ValueError):
        cpu_gguf.gemv(x, w, "Q4_K")
    with pytest.raises(ValueError):
        cpu_gguf.gemv(torch.zeros(64, 2).T, w, "Q4_1")  # columns not contiguous
    with pytest.raises(ValueError):
        cpu_gguf.gemv(x, w, "Q4_1", bias=torch.zeros(4))
    with pytest.raises(ValueError):
        cpu_gguf.gemv(x, w, "Q4_1", out=torch.zeros(2, 4))
    with pytest.raises(ValueError):
        cpu_gguf.GgufLinear(w[:, :30], "Q4_1", None)
    with pytest.raises(ValueError):
        cpu_gguf.GgufLinear(w, "F16", None)
    assert cpu_gguf.gemv(torch.zeros(0, 64), w, "Q4_1").shape == (0, 3)


def _tiny_blocks(model, types: dict[str, str]) -> dict:
    """Blocks for the tiny model's matrices (type per checkpoint name, default Q8_0; None rows for
    other types), with each kept matrix's float32 weights set to the blocks' values."""
    blocks = {}
    with torch.no_grad():
        for name, view in model.checkpoint_views().items():
            if view.dim() != 2:
                continue
            qtype = types.get(name, "Q8_0")
            if qtype not in cpu_gguf.TYPES:
                blocks[name] = (qtype, None)
                continue
            rows = gguf_quantize(view.detach().numpy(), GGMLQuantizationType[qtype])
            view.copy_(cpu_gguf.dequantize(torch.from_numpy(rows), qtype))
            blocks[name] = (qtype, rows)
    return blocks


def test_format_on_the_tiny_model_with_fallbacks():
    from engine.cpu_gemm import Projection
    from engine.loader import load_model

    model = load_model("tiny", backend="torch")[0]
    q = "layers.0.self_attn."
    blocks = _tiny_blocks(model, {f"{q}k_proj.weight": "Q4_1", "layers.1.mlp.down_proj.weight": "F16",
                                  "layers.2.mlp.up_proj.weight": "Q4_1",
                                  "layers.2.mlp.gate_proj.weight": "Q4_1"})
    kept = model.layers[2].mlp.gate_up_proj.weight.detach().clone()
    info = weight_format.apply(model, "gguf", blocks)
    assert set(info["fallback"]) == {f"{q}q_proj.weight + {q}k_proj.weight + {q}v_proj.weight",
                                     "layers.1.mlp.down_proj.weight"}
    lowp = {m: m.lowp for m in model.modules() if isinstance(m, Projection)}
    assert isinstance(lowp[model.layers[0].self_attn.qkv_proj], cpu_lowp.LowpLinear)  # mixed Q8_0/Q4_1
    assert isinstance(lowp[model.layers[1].mlp.down_proj], cpu_lowp.LowpLinear)
    assert sum(isinstance(v, cpu_gguf.GgufLinear) for v in lowp.values()) == len(lowp) - 2
    assert model.layers[2].mlp.gate_up_proj.lowp.qtype == "Q4_1"
    assert torch.equal(model.layers[2].mlp.gate_up_proj.weight, kept)  # kept weights untouched
    assert isinstance(model.logits_lowp, cpu_gguf.GgufLinear) and model.logits_lowp.qtype == "Q8_0"
    for module, x in ((model.layers[2].mlp.gate_up_proj, torch.randn(3, 128)),
                      (model.layers[3].self_attn.o_proj, torch.randn(2, 128))):
        torch.testing.assert_close(module(x), x @ module.weight.T, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError):  # blocks that are not the loaded weights
        weight_format.apply(load_model("tiny", backend="torch")[0], "gguf", blocks)


def test_gguf_needs_a_gguf_model():
    from engine.engine import EngineConfig
    from engine.loader import load_model

    assert EngineConfig(weights="gguf").weights == "gguf"
    with pytest.raises(ValueError, match="GGUF"):
        load_model("tiny", backend="torch", weights="gguf")
    with pytest.raises(ValueError, match="GGUF"):
        weight_format.apply(load_model("tiny", backend="torch")[0], "gguf")
    with pytest.raises(ValueError):
        weight_format.check_name("q4_1")


@SKIP
def test_smollm2_gguf_greedy_equals_f32():
    from engine.cpu_gemm import Projection
    from engine.engine import EngineConfig, LLMEngine
    from engine.identity import model_identity
    from engine.loader import load_model
    from engine.sampling import SamplingParams

    f32 = engine_model()
    gguf = load_model("smollm2", device="cpu", backend="torch", weights="gguf")
    model = gguf[0]
    assert all(isinstance(m.lowp, cpu_gguf.GgufLinear) for m in model.modules() if isinstance(m, Projection))
    assert model.logits_lowp.qtype == "Q8_0"
    assert model_identity(gguf[1], model) == model_identity(f32[1], f32[0])
    assert weight_format.decode_weight_bytes(f32[0]) > 5 * weight_format.decode_weight_bytes(model)
    # a gguf step reads exactly the file's matrices, as llama.cpp's does (bench engine compares the two)
    from bench.step_bandwidth import step_weight_bytes
    from model_files.gguf import resolve_model_spec

    assert weight_format.decode_weight_bytes(model) == step_weight_bytes(resolve_model_spec("smollm2"))
    prompts = [f32[2].encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    tokens = {}
    for name, loaded in (("f32", f32), ("gguf", gguf)):
        eng = LLMEngine(EngineConfig(model="smollm2", weights=name, num_blocks=32, num_host_blocks=0),
                        loaded=loaded)
        tokens[name] = [c.choices[0]["token_ids"] for c in eng.generate(prompts, params)]
    assert tokens["gguf"] == tokens["f32"]


def _q8_bound(x: torch.Tensor, w: torch.Tensor, qtype: str, ref: torch.Tensor) -> torch.Tensor:
    """float32 error bound of the q8 kernel: it sums d (w . q) and m (sum of x) apart, so K ulps of
    sum |x| (|d q| + |m|), on x as rounded."""
    q, d = cpu_gguf.quantize_q8(x)
    xr = (q.double().view(q.shape[0], -1, 32) * d.double()[..., None]).view(q.shape).abs()  # (M, K)
    N = w.shape[0]
    blocks = w.reshape(N, -1, cpu_gguf.TYPES[qtype])
    scale = blocks[..., 0:2].contiguous().view(torch.float16).double().abs()  # (N, nb, 1)
    if qtype == "Q4_1":
        codes = torch.cat([blocks[..., 4:].long() & 15, blocks[..., 4:].long() >> 4], -1).double()
        mag = scale * codes + blocks[..., 2:4].contiguous().view(torch.float16).double().abs()
    else:
        mag = scale * blocks[..., 2:].contiguous().view(torch.int8).double().abs()
    return (xr @ mag.reshape(N, -1).T) * x.shape[1] * 2.0 ** -23 + ref.abs() * 2.0 ** -23 + 1e-30


@settings(max_examples=60, deadline=None)
@given(qtype=st.sampled_from(sorted(cpu_gguf.TYPES)), M=st.integers(1, 6), N=st.integers(1, 37),
       nb=st.integers(1, 40), pad=st.integers(0, 3), out_pad=st.integers(0, 2), bias=st.booleans(),
       seed=st.integers(0, 999), threads=st.sampled_from([1, 2]))
def test_q8_gemv_matches_float64_reference(qtype, M, N, nb, pad, out_pad, bias, seed, threads):
    """x rounded to int8 blocks: the kernel against the float64 product of the rounded x and the
    blocks (block counts past one chunk of 16 scales, strided x and out, a bias, 1 and 2 threads)."""
    K = nb * cpu_gguf.BLOCK
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K + pad, generator=g)[:, :K] * torch.rand(1, K, generator=g) * 4
    w = special_scales(random_blocks(qtype, N, nb, seed))
    b = torch.randn(N, generator=g) if bias else None
    out = torch.full((M, N + out_pad), float("nan"))[:, :N]
    y = _with_threads(threads, lambda: cpu_gguf.gemv(x, w, qtype, b, out=out, act="q8"))
    ref = cpu_gguf.reference(x, w, qtype, b, act="q8")  # (M, N) float64
    assert ((y.double() - ref).abs() <= _q8_bound(x, w, qtype, ref)).all()
    assert torch.equal(cpu_gguf.GgufLinear(w, qtype, b, act="q8")(x), _with_threads(
        threads, lambda: cpu_gguf.gemv(x.contiguous(), w, qtype, b, act="q8")))


def test_q8_rounding_is_torchs():
    """The kernel's int8 codes and scales: max |x| / 127 per block of 32, codes rounded to the
    nearest with ties to even, as torch computes them (zero blocks, ties and extremes included)."""
    x = torch.randn(3, 128) * 3
    x[0, :32] = 0.0  # a zero block: scale 0, codes 0
    x[1, 32:64] = torch.arange(32) * 0.5 - 8  # exact halves after scaling: ties
    x[2, 64:96] = torch.tensor([1e-30, -1e30] * 16)
    q, d = cpu_gguf.quantize_q8(x)
    blocks = x.view(3, -1, 32)
    amax = blocks.abs().amax(-1)  # (3, 4)
    scale = amax / 127.0
    inv = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
    codes = torch.round(blocks * inv[..., None]).to(torch.int8).view(3, 128)
    assert torch.equal(d, scale) and torch.equal(q, codes)
    assert q.abs().max() <= 127


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_q8_non_finite_x_gives_nan_rows_not_garbage(qtype, bad):
    """A row of x holding inf or nan comes out nan (as the float32 path's would), the other rows
    as without it: the kernel never converts a non-finite value to an int8 code."""
    w = random_blocks(qtype, 40, 4, seed=11)
    x = torch.randn(3, 128)
    want = cpu_gguf.gemv(x, w, qtype, act="q8")
    x[1, 70] = bad
    got = cpu_gguf.gemv(x, w, qtype, act="q8")
    assert torch.isnan(got[1]).all()
    assert torch.equal(got[[0, 2]], want[[0, 2]])
    q, d = cpu_gguf.quantize_q8(x)
    assert torch.isnan(d[1, 2]) and not q[1, 64:96].any()


@pytest.mark.parametrize("march", ["x86-64", "haswell", "icelake-server"])  # plain C; maddubs; VNNI
def test_q8_other_instruction_sets(march, tmp_path, monkeypatch):
    import platform

    cc = shutil.which("cc") or shutil.which("gcc")
    if platform.machine() not in ("x86_64", "AMD64") or cc is None:
        pytest.skip("x86 builds with a C compiler")
    flags = [f for f in cpu_kernels.COMMON if f != "-march=native"] + [f"-march={march}"]
    out = tmp_path / f"gguf_q8-{march}.so"
    subprocess.run([cc, *flags, *cpu_kernels.LIBRARIES["gguf_q8"][0], str(cpu_kernels.CSRC / "gguf_q8.c"),
                    "-o", str(out)], check=True, capture_output=True, timeout=120)
    lib = ctypes.CDLL(str(out))
    for name, (args, result) in cpu_kernels.LIBRARIES["gguf_q8"][1].items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, result
    if march == "icelake-server" and not {"avx512_vnni", "avx512vl"} <= _cpu_flags():
        pytest.skip("this CPU lacks AVX-512 VNNI")
    assert lib.pd_gguf_q8_simd() == (march != "x86-64")
    monkeypatch.setattr(cpu_gguf, "_lib", lambda act="f32": lib)
    for qtype in cpu_gguf.TYPES:
        for M, N, nb in ((1, 9, 3), (3, 6, 17), (4, 5, 1)):
            x = torch.randn(M, nb * 32, generator=torch.Generator().manual_seed(M))
            w = special_scales(random_blocks(qtype, N, nb, seed=N))
            y, ref = cpu_gguf.gemv(x, w, qtype, act="q8"), cpu_gguf.reference(x, w, qtype, act="q8")
            assert ((y.double() - ref).abs() <= _q8_bound(x, w, qtype, ref)).all()


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {flag for line in f if line.startswith("flags") for flag in line.split(":")[1].split()}
    except OSError:
        return set()


@SKIP
def test_smollm2_gguf_q8_is_another_function_of_the_same_weights():
    """gguf-q8 rounds activations: another model identity than gguf's (workers never mix them), and
    through its decode kernels its argmax mostly, not always, follows f32's over a text."""
    from bench.weights import TEXT, text_logits
    from engine.identity import model_identity
    from engine.loader import load_model

    f32 = engine_model()
    q8 = load_model("smollm2", device="cpu", backend="torch", weights="gguf-q8")
    assert all(lin.act == "q8" for lin in (q8[0].logits_lowp, q8[0].layers[0].mlp.down_proj.lowp))
    assert model_identity(q8[1], q8[0]) != model_identity(f32[1], f32[0])
    ids = f32[2].encode(TEXT.read_text())[:96]
    ref, got = text_logits(f32[0], f32[1], ids, 4), text_logits(q8[0], q8[1], ids, 4)  # (96, V) each
    agree = (ref.argmax(-1) == got.argmax(-1)).double().mean().item()
    assert agree >= 0.85
    assert (got - ref).abs().max() > 0  # the rounding is there
