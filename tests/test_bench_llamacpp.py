"""llama.cpp as bench engine's baseline (bench.llamacpp). With llama-cpp-python installed: the
runner's greedy tokens on SmolLM2's GGUF start as pdserve's float32 engine's do for a short text
prompt, its numbers are sane, a batched run's first sequence equals the single stream, and
bench engine's JSON and printout carry the llama.cpp section (transformers stubbed out to keep it
short). Without it (the import made to fail): one note, and bench engine's report otherwise as
before. No timing is asserted."""

import importlib.util
import json
import sys

import pytest

from bench import llamacpp

needs_llama = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                 reason="llama-cpp-python is not installed")


@pytest.fixture(scope="module")
def gguf_and_buffers():
    from model_files.gguf import resolve_model_spec

    path = resolve_model_spec("smollm2")
    return path, llamacpp.extra_buffers_work(path, 1)


@needs_llama
def test_runner_agrees_with_pdserve_f32(gguf_and_buffers):
    from engine.engine import EngineConfig, LLMEngine
    from engine.sampling import SamplingParams

    path, extra = gguf_and_buffers
    eng = LLMEngine(EngineConfig(model="smollm2", weights="f32", num_blocks=16, num_host_blocks=0))
    prompt = eng.tokenizer.encode("The capital of France is")
    ours = eng.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0].choices[0]["token_ids"]
    runner = llamacpp.LlamaCpp(path, 1, 64, 2, extra_buffers=extra)
    try:
        one = runner.single(prompt, 4)
        two = runner.batched([prompt, [1] + list(range(300, 320))], 4)
    finally:
        runner.close()
    # same weights, different arithmetic (llama.cpp rounds activations to 8 bits): the first tokens agree
    assert one["outputs"][0][:3] == ours[:3], (one["outputs"][0], ours)
    assert one["tokens"] == 4 and one["prefill_s"] > 0 and one["decode_tokens_per_s"] > 0
    assert two["outputs"][0] == one["outputs"][0] and [len(o) for o in two["outputs"]] == [4, 4]
    assert two["tokens"] == 8 and two["tokens_per_s"] > 0


@needs_llama
def test_bench_engine_reports_llamacpp(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    import bench.engine_speed as be

    def fake_hf(directory, prompts, max_tokens, gguf_file=None, dtype="float32", device="cpu"):
        n = len(prompts) * max_tokens
        return {"tokens": n, "seconds": 1.0, "tokens_per_s": n, "outputs": [[0] * max_tokens] * len(prompts)}

    monkeypatch.setattr(be, "run_hf", fake_hf)
    path = tmp_path / "engine.json"
    be.run(num_prompts=2, max_tokens=3, min_prompt=12, max_prompt=16, repeats=1, model="smollm2",
           json_path=str(path))
    section = json.loads(path.read_text())["llamacpp"]
    for key in ("ratio_batched", "ratio_single_decode", "batched_tokens_per_s_median",
                "single_decode_tokens_per_s_median", "pdserve_single_decode_tokens_per_s_median"):
        assert section[key] > 0, key
    assert section["config"]["threads"] == 1 and section["num_prompts"] == 2
    assert section["greedy"]["batched_first_equals_single"]
    assert len(section["runs"]["batched"]) == len(section["runs"]["pdserve_single"]) == 1
    use = section["single_decode_bandwidth"]
    assert use["pdserve"]["weight_bytes_per_step"] > 5 * use["llamacpp"]["weight_bytes_per_step"] > 0  # f32
    for side in ("pdserve", "llamacpp"):
        u = use[side]
        assert u["fraction_of_copy_bandwidth"] == pytest.approx(
            u["bytes_per_step_over_step_time_gb_s"] / use["memory_copy_gb_per_s"])
    out = capsys.readouterr().out
    assert "llama.cpp baseline: llama-cpp-python" in out and "pdserve/llama.cpp" in out
    assert "weight bytes per step over step time" in out


def test_without_llama_cpp_one_note(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now raises ImportError
    base, note = llamacpp.setup("smollm2", "cpu", "float32", [[1, 2, 3]], 2, "f32", 1)
    assert base is None and "not installed" in note and "llamacpp" in note
    pytest.importorskip("transformers")
    from bench.engine_speed import run

    path = tmp_path / "engine.json"
    result = run(num_prompts=2, max_tokens=2, min_prompt=8, max_prompt=10, repeats=1, json_path=str(path))
    out = capsys.readouterr().out
    assert out.count("llama.cpp baseline: skipped, llama-cpp-python is not installed") == 2  # setup + run
    assert "pdserve/llama.cpp" not in out
    body = json.loads(path.read_text())
    assert body["llamacpp"] == {"skipped": note}
    assert result["speedup_vs_transformers"] == body["speedup_vs_transformers"]
