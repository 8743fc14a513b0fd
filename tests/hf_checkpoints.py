"""Tiny Hugging Face checkpoints for the engine's model tests (test_model_hf.py,
test_model_hf_loading.py): random Llama, Qwen2 and Mistral configurations built with
transformers, weights perturbed away from HF's init so logits are not near uniform, saved as
safetensors (one of them sharded), with transformers' own logits and greedy ids as the
reference. Skips the importing module when transformers is not installed.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 300
NEW_TOKENS = 32
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
CASES = {
    # name: (config class, extra config kwargs, save sharded)
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True, bos_token_id=1, eos_token_id=2), False),
    "qwen2_bias_untied_sharded": ("Qwen2Config", dict(tie_word_embeddings=False, eos_token_id=5), True),
    "mistral_untied": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None), False),
    "llama3_rope_biases": ("LlamaConfig", dict(
        tie_word_embeddings=False, attention_bias=True, mlp_bias=True, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=16)), False),
}


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial weights: HF init gives zero biases, unit norms and near-uniform logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.3 * noise)
            else:
                p.copy_(noise * 1.5 / p.shape[-1] ** 0.5)


def _prompts(seed: int, lengths=(5, 13, 22)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, VOCAB, (n,), generator=gen).tolist() for n in lengths]


class Checkpoint:
    def __init__(self, name: str, root):
        cls_name, extra, sharded = CASES[name]
        cfg = getattr(transformers, cls_name)(**SMALL, **extra)
        arch = cls_name.replace("Config", "ForCausalLM")
        torch.manual_seed(0)
        self.hf = getattr(transformers, arch)(cfg).eval()
        _perturb(self.hf, seed=len(name))
        self.hf.generation_config.eos_token_id = None  # always generate all NEW_TOKENS
        self.dir = str(root / name)
        kw = dict(max_shard_size="60KB") if sharded else {}
        self.hf.save_pretrained(self.dir, safe_serialization=True, **kw)
        self.prompts = _prompts(seed=len(name))

    def hf_logits(self, prompt: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            return self.hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()  # (L, V)

    def hf_greedy(self, prompt: list[int]) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = self.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                   do_sample=False, pad_token_id=0, min_new_tokens=0)
        return out[0, len(prompt):].tolist()


def one_torch_thread():
    """Generator behind each module's autouse fixture: these shapes are tiny, so one intra-op
    thread is faster and fair to a shared 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
