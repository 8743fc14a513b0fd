"""engine.cpu_decode_layers: a decode step's decoder layers in one C call.

On the tiny model with its matrices as GGUF blocks (Q4_1 and Q8_0, both activation modes) or as
bf16: every
step's logits and the whole KV pool bit for bit those of the Python path, for decode batches of
1 to 8 rows with sequences of different lengths; steps it does not serve (prefill, more rows than
the kernels take) go the Python way; and a model that does not qualify gets no C path.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from engine import cpu_gguf, weight_format
from engine.cpu_decode_layers import DecodeLayers

pytestmark = pytest.mark.skipif(not cpu_gguf.available(), reason="no C compiler for the kernels")


def gguf_tiny(act: str):
    """The tiny model (float32, CPU) with every matrix as GGUF blocks (down projections Q4_1, the
    rest Q8_0) in `act` mode, packed and fused like the loader does; act "bf16": the loader's bf16."""
    from engine.loader import load_model

    if act == "bf16":
        return load_model("tiny", backend="torch", weights="bf16")
    model, config, tok = load_model("tiny", backend="torch")
    blocks = {}
    with torch.no_grad():
        for name, view in model.checkpoint_views().items():
            if view.dim() != 2:
                continue
            qtype = "Q4_1" if "down_proj" in name else "Q8_0"
            rows = gguf_quantize(view.detach().numpy().astype(np.float32), GGMLQuantizationType[qtype])
            view.copy_(cpu_gguf.dequantize(torch.from_numpy(rows), qtype))
            blocks[name] = (qtype, rows)
    weight_format.apply(model, "gguf" if act == "f32" else "gguf-q8", blocks)
    model.pack_cpu_gemm(True)
    model.use_cpu_fused(True)
    model.decode_layers = DecodeLayers.build(model)
    return model, config, tok


def _run(loaded, c_path: bool, prompts: list[list[int]]):
    """Greedy generation; (every step's logits, the final pool, steps the C path served)."""
    from engine.engine import EngineConfig, LLMEngine
    from engine.sampling import SamplingParams

    model = loaded[0]
    runner = model.decode_layers
    served = [0]
    logits: list[torch.Tensor] = []
    original = model.compute_logits
    if c_path:
        run = runner.run

        def counting(*args):
            ok = run(*args)
            served[0] += ok
            return ok
        runner.run = counting
    model.decode_layers = runner if c_path else None
    model.compute_logits = lambda h: logits.append(original(h).clone()) or logits[-1]
    try:
        config = EngineConfig(model="tiny", num_blocks=64, num_host_blocks=0, block_size=8)
        eng = LLMEngine(config, loaded=loaded)
        lens = [9, 14, 11, 20, 7, 16, 12, 10, 18, 8]
        for p, n in zip(prompts, lens):
            eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True))
        while eng.has_work():
            eng.step()
        return logits, eng.storage.data.clone(), served[0]
    finally:
        model.compute_logits = original
        model.decode_layers = runner
        if c_path:
            del runner.run


@pytest.mark.parametrize("act", ["f32", "q8", "bf16"])
@pytest.mark.parametrize("count", [1, 3, 8, 10])
def test_bit_for_bit_the_python_path(act, count):
    loaded = gguf_tiny(act)
    rows = loaded[0].decode_layers.max_rows  # GGUF kernels 8, bf16 4
    assert loaded[0].decode_layers is not None
    prompts = [[(7 * i + j) % 250 + 1 for j in range(5 + 3 * i)] for i in range(count)]
    c_logits, c_pool, served = _run(loaded, True, prompts)
    py_logits, py_pool, _ = _run(loaded, False, prompts)
    assert len(c_logits) == len(py_logits)
    assert all(torch.equal(a, b) for a, b in zip(c_logits, py_logits))
    assert torch.equal(c_pool, py_pool)
    if count <= rows:
        assert served > 5  # decode steps of 1..count rows
    else:
        assert served > 0  # more rows go the Python way until sequences finish and few enough remain


def test_only_gguf_models_with_the_kernels_qualify():
    from engine.loader import load_model

    model = load_model("tiny", backend="torch")[0]
    assert model.decode_layers is None and DecodeLayers.build(model) is None  # f32 projections
    assert load_model("tiny", backend="torch", weights="int8")[0].decode_layers is None  # a scale per row
    gguf = gguf_tiny("f32")[0]
    gguf.use_cpu_fused(False)
    assert DecodeLayers.build(gguf) is None  # the torch elementwise path
