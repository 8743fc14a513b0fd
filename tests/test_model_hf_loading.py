"""engine/ loading Hugging Face checkpoints (hf_checkpoints.py): config fields read from
config.json, HF config variants (sliding window, legacy rope scaling, list eos ids), a sharded
checkpoint loaded through its index (a stray shard ignored), missing or unexpected weights and
unsupported architectures refused by name, and the tokenizers: the byte tokenizer's round trip
and tokenizer.json used when present. The logits and greedy oracle is in test_model_hf.py.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from hf_checkpoints import CASES, SMALL, VOCAB, Checkpoint, one_torch_thread, transformers

from engine.loader import CheckpointError, load_model
from engine.model_config import ModelConfig, UnsupportedModelError
from model_files.tokenizer import ByteTokenizer, load_tokenizer


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from one_torch_thread()


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    return Checkpoint(request.param, tmp_path_factory.mktemp("hf"))


def test_config_fields_from_checkpoint(checkpoint):
    with open(os.path.join(checkpoint.dir, "config.json")) as f:
        cfg = ModelConfig.from_hf_config(json.load(f))
    hf = checkpoint.hf.config
    shape = (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    assert shape == (VOCAB, 64, 2, 4, 2, 16)
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    hf_bias = bool(getattr(hf, "attention_bias", False))
    assert cfg.attention_bias == (cfg.architecture == "Qwen2ForCausalLM" or hf_bias)
    assert cfg.o_proj_bias == (cfg.architecture == "LlamaForCausalLM" and hf_bias)
    if hf.eos_token_id is not None:
        assert cfg.eos_token_ids == (hf.eos_token_id,)
    layout = cfg.kv_layout(16)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size) == (2, 2, 16, 16)


def test_sharded_index_is_used(tmp_path_factory):
    checkpoint = Checkpoint("qwen2_bias_untied_sharded", tmp_path_factory.mktemp("shard"))
    assert os.path.isfile(os.path.join(checkpoint.dir, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(checkpoint.dir) if f.endswith(".safetensors")]) > 1
    # A stray safetensors file not named by the index must be ignored, not loaded.
    from safetensors.torch import save_file

    save_file({"model.bogus.weight": torch.zeros(2)}, os.path.join(checkpoint.dir, "stray.safetensors"))
    model, _, _ = load_model(checkpoint.dir, backend="torch")
    ref = dict(checkpoint.hf.named_parameters())
    for name, p in model.checkpoint_views().items():  # fused q/k/v, gate/up: one slice per key
        key = name if name == "lm_head.weight" else f"model.{name}"
        assert torch.equal(p, ref[key]), key


def _edit_weights(directory: str, key: str, fn) -> None:
    """Apply fn to the tensors of the file holding `key` (the first shard for a new key)."""
    from safetensors.torch import load_file, save_file

    name = "model.safetensors"
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        name = weight_map.get(key, sorted(weight_map.values())[0])
    path = os.path.join(directory, name)
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_and_unexpected_weights_are_refused(checkpoint, tmp_path):
    bad = str(tmp_path / "missing")
    shutil.copytree(checkpoint.dir, bad)
    gone = "model.layers.1.mlp.up_proj.weight"
    _edit_weights(bad, gone, lambda t: t.pop(gone))
    with pytest.raises(CheckpointError, match=r"missing model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(bad, backend="torch")
    extra = str(tmp_path / "extra")
    shutil.copytree(checkpoint.dir, extra)
    new = "model.layers.0.mystery.weight"
    _edit_weights(extra, new, lambda t: t.__setitem__(new, torch.zeros(3)))
    with pytest.raises(CheckpointError, match=r"unexpected model\.layers\.0\.mystery\.weight"):
        load_model(extra, backend="torch")


def test_unsupported_architecture_is_refused(tmp_path):
    cfg = dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=100)
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        ModelConfig.from_hf_config(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model(str(tmp_path))
    llama = transformers.LlamaConfig(**SMALL).to_dict() | {"architectures": ["LlamaForCausalLM"]}
    yarn = llama | {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_hf_config(yarn)
    with pytest.raises(UnsupportedModelError, match="gelu"):
        ModelConfig.from_hf_config(llama | {"hidden_act": "gelu"})
    with pytest.raises(FileNotFoundError, match="neither 'tiny' nor"):
        load_model(str(tmp_path / "nope"))


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer(512, bos_token_id=256, eos_token_ids=(257,))
    text = "héllo, wörld — 你好 🙂\n"
    ids = tok.encode(text)
    assert ids[0] == 256 and ids[1:] == list(text.encode("utf-8"))
    assert tok.decode(ids + [257, 300]) == text
    assert tok.encode("ab", add_special_tokens=False) == [97, 98]
    assert tok.decode(list("你".encode())[:2]) == "\ufffd"  # cut multi-byte char: replaced, no raise
    with pytest.raises(ValueError):
        ByteTokenizer(100, None)


def test_tokenizer_json_is_used_when_present(checkpoint, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tk = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator(["the cache pages blocks", "prefill then decode the blocks"],
                           trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>", "</s>"]))
    directory = str(tmp_path / "withtok")
    shutil.copytree(checkpoint.dir, directory)
    tk.save(os.path.join(directory, "tokenizer.json"))
    _, config, tok = load_model(directory, backend="torch")
    assert tok.kind == "hf" and tok.vocab_size == tk.get_vocab_size()
    ids = tok.encode("prefill the blocks")
    assert ids == [tk.token_to_id(w) for w in ("prefill", "the", "blocks")]
    assert tok.decode(ids).split() == ["prefill", "the", "blocks"]
    assert tok.encode("zebra") == [tk.token_to_id("[UNK]")]
    assert load_tokenizer(checkpoint.dir, config).kind == "byte"  # no tokenizer.json there


def test_hf_config_variants():
    mistral = transformers.MistralConfig(**SMALL, sliding_window=64).to_dict()
    cfg = ModelConfig.from_hf_config(mistral | {"architectures": ["MistralForCausalLM"]})
    assert cfg.max_position_embeddings == 64  # exact only within the window: capped there
    legacy = dict(architectures=["LlamaForCausalLM"], vocab_size=300, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, rope_theta=5e5, eos_token_id=[7, 9],
                  rope_scaling={"type": "linear", "factor": 2.0}, torch_dtype="bfloat16")
    cfg = ModelConfig.from_hf_config(legacy)
    assert cfg.rope_theta == 5e5 and cfg.num_kv_heads == 4 and cfg.head_dim == 16
    assert cfg.rope_scaling_dict["rope_type"] == "linear" and cfg.rope_scaling_dict["factor"] == 2.0
    assert cfg.eos_token_ids == (7, 9) and cfg.eos_token_id == 7 and cfg.dtype == "bfloat16"
    assert cfg.kv_layout(8, torch.float16).dtype == "float16"


def test_initializers_are_skipped_only_while_the_model_is_built(tmp_path):
    """engine.loader swaps torch.nn.init's initializers for no-ops around the meta build: after a
    load, and after a build that raised, they initialise again."""
    from engine import loader

    originals = {n: getattr(torch.nn.init, n) for n in ("normal_", "uniform_", "kaiming_uniform_", "zeros_")}
    load_model(Checkpoint(next(iter(CASES)), tmp_path).dir, backend="torch")  # one case: the meta build
    with pytest.raises(RuntimeError, match="mid-build"), loader._initializers_skipped():
        assert torch.nn.init.normal_ is not originals["normal_"]
        raise RuntimeError("mid-build")
    assert {n: getattr(torch.nn.init, n) for n in originals} == originals
    w = torch.zeros(64)
    torch.nn.init.normal_(w)
    assert w.abs().sum() > 0
