"""Correctness oracle for engine/ (model, loader, rope, tokenizer): tiny random Llama, Qwen2 and
Mistral checkpoints built with transformers and saved as safetensors (one of them sharded) are
loaded by engine.loader; full-prompt logits must match transformers' forward in float32 and
greedy ids over 32 new tokens must equal `generate(do_sample=False)`, with the engine side
running through the paged KV cache (KVCacheManager + KVStorage + AttentionMetadata): one packed
prefill of ragged prompts, then one packed decode step per token, plus a prefix-cache hit.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from engine.attn_metadata import AttentionMetadata
from engine.config import ModelConfig, UnsupportedModelError
from engine.loader import CheckpointError, load_model
from engine.model import logits_indices
from engine.tokenizer import ByteTokenizer, load_tokenizer
from kvcache import BlockAllocator, KVCacheManager, KVStorage

transformers = pytest.importorskip("transformers")

VOCAB = 300
NEW_TOKENS = 32
BLOCK = 4
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


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """These shapes are tiny: one intra-op thread is faster and fair to a shared 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=list(CASES))
def ckpt(request, tmp_path_factory):
    return Checkpoint(request.param, tmp_path_factory.mktemp("hf"))


class PagedRunner:
    """Minimal greedy decoding through the paged cache: packed prefill, then packed decode."""

    def __init__(self, model, config: ModelConfig, num_blocks: int = 96):
        self.model = model
        self.storage = KVStorage(config.kv_layout(BLOCK), num_blocks)
        self.mgr = KVCacheManager(BlockAllocator(num_blocks), BLOCK, self.storage)

    def step(self, work: list[tuple[object, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """work: (seq_id, first uncomputed token). Runs every sequence's remaining tokens in one
        packed forward; returns (all new-token logits (T, V), last-token logits (S, V))."""
        ids, pos, tables, seq_lens, q_lens = [], [], [], [], []
        for seq, start in work:
            t = self.mgr.table(seq)
            ids += t.token_ids[start:]
            pos += range(start, t.num_tokens)
            tables.append(list(t.blocks))
            seq_lens.append(t.num_tokens)
            q_lens.append(t.num_tokens - start)
        meta = AttentionMetadata.build(tables, seq_lens, q_lens, BLOCK)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.storage, meta)  # (T, hidden)
            logits = self.model.compute_logits(hidden)  # (T, V)
        for seq, _ in work:
            self.mgr.mark_computed(seq, self.mgr.table(seq).num_tokens)
        return logits, logits[logits_indices(meta)]

    def generate(self, prompts: dict[object, list[int]], n: int):
        """Greedy ids per sequence, prefill logits per sequence, prefix-hit tokens per sequence."""
        hits = {s: self.mgr.allocate(s, p) for s, p in prompts.items()}
        assert None not in hits.values(), "pool too small for the test"
        all_logits, last = self.step([(s, hits[s]) for s in prompts])
        prefill, start = {}, 0
        for s, p in prompts.items():
            prefill[s] = all_logits[start:start + len(p) - hits[s]]
            start += len(p) - hits[s]
        out = {s: [] for s in prompts}
        for _ in range(n):
            for s, row in zip(prompts, last):
                tok = int(row.argmax())
                out[s].append(tok)
                assert self.mgr.append(s, [tok])
            if len(out[next(iter(prompts))]) == n:
                break
            _, last = self.step([(s, self.mgr.table(s).num_tokens - 1) for s in prompts])
        return out, prefill, hits


def test_logits_and_greedy_match_transformers(ckpt):
    model, config, _ = load_model(ckpt.dir, device="cpu", backend="torch")
    assert config.dtype == "float32" and next(model.parameters()).dtype == torch.float32
    runner = PagedRunner(model, config)
    prompts = dict(enumerate(ckpt.prompts))
    ours, prefill, hits = runner.generate(prompts, NEW_TOKENS)
    assert set(hits.values()) == {0}
    for s, prompt in prompts.items():
        torch.testing.assert_close(prefill[s], ckpt.hf_logits(prompt), atol=1e-4, rtol=1e-4)
        ref = ckpt.hf_greedy(prompt)
        assert len(ref) == NEW_TOKENS and len(set(ref)) >= 4, f"degenerate reference output {ref}"
        assert ours[s] == ref, f"prompt {s}: greedy ids differ from transformers"
    runner.mgr.check_integrity()

    # Prefix-cache hit: extend prompt 2 (its full blocks are sealed in the cache); only the
    # suffix is prefilled, on top of paged KV written by the first round.
    for s in prompts:
        runner.mgr.free(s)
    longer = ckpt.prompts[2] + [17, 42, 99]
    ours, prefill, hits = runner.generate({"x": longer}, NEW_TOKENS)
    assert hits["x"] == (len(ckpt.prompts[2]) // BLOCK) * BLOCK > 0
    torch.testing.assert_close(prefill["x"], ckpt.hf_logits(longer)[hits["x"]:], atol=1e-4, rtol=1e-4)
    assert ours["x"] == ckpt.hf_greedy(longer)
    runner.mgr.free("x")
    runner.mgr.check_integrity()


def test_config_fields_from_checkpoint(ckpt):
    with open(os.path.join(ckpt.dir, "config.json")) as f:
        cfg = ModelConfig.from_hf_config(json.load(f))
    hf = ckpt.hf.config
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
    ck = Checkpoint("qwen2_bias_untied_sharded", tmp_path_factory.mktemp("shard"))
    assert os.path.isfile(os.path.join(ck.dir, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(ck.dir) if f.endswith(".safetensors")]) > 1
    # A stray safetensors file not named by the index must be ignored, not loaded.
    from safetensors.torch import save_file

    save_file({"model.bogus.weight": torch.zeros(2)}, os.path.join(ck.dir, "stray.safetensors"))
    model, _, _ = load_model(ck.dir, backend="torch")
    ref = dict(ck.hf.named_parameters())
    for name, p in model.named_parameters():
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


def test_missing_and_unexpected_weights_are_refused(ckpt, tmp_path):
    bad = str(tmp_path / "missing")
    shutil.copytree(ckpt.dir, bad)
    gone = "model.layers.1.mlp.up_proj.weight"
    _edit_weights(bad, gone, lambda t: t.pop(gone))
    with pytest.raises(CheckpointError, match=r"missing model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(bad, backend="torch")
    extra = str(tmp_path / "extra")
    shutil.copytree(ckpt.dir, extra)
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


def test_tiny_model_is_deterministic_and_uses_bytes():
    m1, c1, tok1 = load_model("tiny", backend="torch")
    m2, c2, _ = load_model("tiny", backend="torch")
    assert c1 == c2 and c1.vocab_size == 512
    p1, p2 = dict(m1.named_parameters()), dict(m2.named_parameters())
    assert p1.keys() == p2.keys() and all(torch.equal(p1[k], p2[k]) for k in p1)
    assert not torch.equal(p1["layers.0.self_attn.q_proj.weight"], p1["layers.1.self_attn.q_proj.weight"])
    assert isinstance(tok1, ByteTokenizer) and tok1.bos_token_id == 256 and tok1.eos_token_id == 257
    outs = []
    for m in (m1, m2):
        runner = PagedRunner(m, c1, num_blocks=16)
        out, _, _ = runner.generate({0: tok1.encode("The paged cache")}, 8)
        outs.append(out[0])
    assert outs[0] == outs[1] and all(0 <= t < 512 for t in outs[0])


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


def test_tokenizer_json_is_used_when_present(ckpt, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tk = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator(["the cache pages blocks", "prefill then decode the blocks"],
                           trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>", "</s>"]))
    directory = str(tmp_path / "withtok")
    shutil.copytree(ckpt.dir, directory)
    tk.save(os.path.join(directory, "tokenizer.json"))
    _, config, tok = load_model(directory, backend="torch")
    assert tok.kind == "hf" and tok.vocab_size == tk.get_vocab_size()
    ids = tok.encode("prefill the blocks")
    assert ids == [tk.token_to_id(w) for w in ("prefill", "the", "blocks")]
    assert tok.decode(ids).split() == ["prefill", "the", "blocks"]
    assert tok.encode("zebra") == [tk.token_to_id("[UNK]")]
    assert load_tokenizer(ckpt.dir, config).kind == "byte"  # no tokenizer.json there


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
