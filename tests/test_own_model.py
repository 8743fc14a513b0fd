"""A user's own Hugging Face checkpoint folder (docs/own-model.md): a config.json without
`architectures` runs when its `model_type` is one this engine supports (an unsupported one is
refused naming it), and `generate --local` computes in the format `up` and `serve` would serve the
folder in (pdserve_cli.weights_arg.resolve), which its `system_fingerprint` names."""

from __future__ import annotations

import json
import os

import pytest
from hf_checkpoints import Checkpoint

from engine.model_config import ModelConfig, UnsupportedModelError
from pdserve_cli.main import main
from pdserve_cli.weights_arg import resolve


@pytest.fixture(scope="module")
def no_architectures(tmp_path_factory) -> Checkpoint:
    """A Llama checkpoint whose config.json names only its model_type (as some exports do)."""
    ckpt = Checkpoint("llama_tied", tmp_path_factory.mktemp("own"))
    path = os.path.join(ckpt.dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    assert cfg.pop("architectures") and cfg["model_type"] == "llama"
    with open(path, "w") as f:
        json.dump(cfg, f)
    return ckpt


def test_model_type_names_the_architecture():
    llama = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4}
    assert ModelConfig.from_hf_config(llama).architecture == "LlamaForCausalLM"
    assert ModelConfig.from_hf_config({**llama, "model_type": "qwen2"}).architecture == "Qwen2ForCausalLM"
    with pytest.raises(UnsupportedModelError, match="no architectures and its model_type 'gpt2'"):
        ModelConfig.from_hf_config({**llama, "model_type": "gpt2"})


def test_a_folder_without_tokenizer_json_is_said(no_architectures, caplog):
    """The byte-level fallback is right for a byte-level model only: a warning names it."""
    from engine.loader import load_model

    with caplog.at_level("WARNING", logger="engine.loader"):
        load_model(no_architectures.dir, backend="torch")
    assert "has no tokenizer.json: text is encoded as bytes" in caplog.text


def test_generate_local_runs_the_folder_in_the_serving_format(no_architectures, capsys):
    ckpt = no_architectures
    prompt = ckpt.prompts[0]
    code = main(["generate", "--local", "--model", ckpt.dir, "--prompt-ids", ",".join(map(str, prompt)),
                 "--max-tokens", "4", "--ignore-eos", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    body = json.loads(out.out)
    assert len(body["choices"][0]["token_ids"]) == 4
    assert resolve(None, "cpu", ckpt.dir) == "bf16"  # what `up` and `serve` pick for this folder
    assert body["system_fingerprint"] == "pdserve-bf16"
