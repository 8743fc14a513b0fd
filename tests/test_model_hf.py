"""Correctness oracle for engine/ (model, loader, rope): tiny random Llama, Qwen2 and Mistral
checkpoints (hf_checkpoints.py) are loaded by engine.loader; full-prompt logits must match
transformers' forward in float32 and greedy ids over 32 new tokens must equal
`generate(do_sample=False)`, with the engine side running through the paged KV cache
(KVCacheManager + KVStorage + AttentionMetadata): one packed prefill of ragged prompts, then one
packed decode step per token, plus a prefix-cache hit; with the projections on F.linear and on
oneDNN's packed weights (engine.cpu_gemm), and decode attention through the torch gather path
and through the compiled CPU kernels (engine.cpu_attention, with engine.cpu_fused for RMSNorm,
rotary and SwiGLU). The built-in tiny model is checked for determinism the same way. Loader,
config and tokenizer checks are in test_model_hf_loading.py.
"""

from __future__ import annotations

import pytest
import torch
from hf_checkpoints import CASES, NEW_TOKENS, Checkpoint, one_torch_thread

from engine import cpu_attention
from engine.attn_metadata import AttentionMetadata
from engine.attn_torch import Workspace
from engine.loader import load_model
from engine.model import logits_indices
from engine.model_config import ModelConfig
from kvcache import BlockAllocator, KVCacheManager, KVStorage
from model_files.tokenizer import ByteTokenizer

BLOCK = 4


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from one_torch_thread()


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    return Checkpoint(request.param, tmp_path_factory.mktemp("hf"))


class PagedRunner:
    """Minimal greedy decoding through the paged cache: packed prefill, then packed decode."""

    def __init__(self, model, config: ModelConfig, num_blocks: int = 96, kernel: bool = False):
        self.model = model
        self.kernel = kernel  # decode attention through engine.cpu_attention's kernel
        self.storage = KVStorage(config.kv_layout(BLOCK), num_blocks)
        self.manager = KVCacheManager(BlockAllocator(num_blocks), BLOCK, self.storage)

    def step(self, work: list[tuple[object, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """work: (seq_id, first uncomputed token). Runs every sequence's remaining tokens in one
        packed forward; returns (all new-token logits (T, V), last-token logits (S, V))."""
        ids, pos, tables, seq_lens, q_lens = [], [], [], [], []
        for seq, start in work:
            t = self.manager.table(seq)
            ids += t.token_ids[start:]
            pos += range(start, t.num_tokens)
            tables.append(list(t.blocks))
            seq_lens.append(t.num_tokens)
            q_lens.append(t.num_tokens - start)
        meta = AttentionMetadata.build(tables, seq_lens, q_lens, BLOCK)
        meta.workspace = Workspace(mirror=False, kernel=self.kernel)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.storage, meta)  # (T, hidden)
            logits = self.model.compute_logits(hidden)  # (T, V)
        for seq, _ in work:
            self.manager.mark_computed(seq, self.manager.table(seq).num_tokens)
        return logits, logits[logits_indices(meta)]

    def generate(self, prompts: dict[object, list[int]], n: int):
        """Greedy ids per sequence, prefill logits per sequence, prefix-hit tokens per sequence."""
        hits = {s: self.manager.allocate(s, p) for s, p in prompts.items()}
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
                assert self.manager.append(s, [tok])
            if len(out[next(iter(prompts))]) == n:
                break
            _, last = self.step([(s, self.manager.table(s).num_tokens - 1) for s in prompts])
        return out, prefill, hits


@pytest.mark.parametrize("gemm,decode", [("torch", "gather"), ("torch", "kernel"), ("onednn", "kernel")])
def test_logits_and_greedy_match_transformers(checkpoint, gemm, decode):
    if decode == "kernel" and not cpu_attention.available():
        pytest.skip("no C compiler for the CPU decode kernel")
    kernels = decode == "kernel"  # the compiled kernels: decode attention and the elementwise steps
    model, config, _ = load_model(checkpoint.dir, device="cpu", backend="torch", cpu_gemm=False,
                                  cpu_fused=kernels)
    assert model.norm.fused == kernels
    if gemm == "onednn":  # these weights are below the size that packs by default: pack them anyway
        model.pack_cpu_gemm(True, min_elements=0)
        assert model.layers[0].mlp.down_proj.packed is not None and model.logits_packed is not None
    assert config.dtype == "float32" and next(model.parameters()).dtype == torch.float32
    runner = PagedRunner(model, config, kernel=kernels)
    prompts = dict(enumerate(checkpoint.prompts))
    ours, prefill, hits = runner.generate(prompts, NEW_TOKENS)
    assert set(hits.values()) == {0}
    for s, prompt in prompts.items():
        torch.testing.assert_close(prefill[s], checkpoint.hf_logits(prompt), atol=1e-4, rtol=1e-4)
        ref = checkpoint.hf_greedy(prompt)
        assert len(ref) == NEW_TOKENS and len(set(ref)) >= 4, f"degenerate reference output {ref}"
        assert ours[s] == ref, f"prompt {s}: greedy ids differ from transformers"
    runner.manager.check_integrity()

    # Prefix-cache hit: extend prompt 2 (its full blocks are sealed in the cache); only the
    # suffix is prefilled, on top of paged KV written by the first round.
    for s in prompts:
        runner.manager.free(s)
    longer = checkpoint.prompts[2] + [17, 42, 99]
    ours, prefill, hits = runner.generate({"x": longer}, NEW_TOKENS)
    assert hits["x"] == (len(checkpoint.prompts[2]) // BLOCK) * BLOCK > 0
    torch.testing.assert_close(prefill["x"], checkpoint.hf_logits(longer)[hits["x"]:], atol=1e-4, rtol=1e-4)
    assert ours["x"] == checkpoint.hf_greedy(longer)
    runner.manager.free("x")
    runner.manager.check_integrity()


def test_tiny_model_is_deterministic_and_uses_bytes():
    m1, c1, tok1 = load_model("tiny", backend="torch")
    m2, c2, _ = load_model("tiny", backend="torch")
    assert c1 == c2 and c1.vocab_size == 512
    p1, p2 = m1.checkpoint_views(), m2.checkpoint_views()  # fused weights as their checkpoint slices
    assert p1.keys() == p2.keys() and all(torch.equal(p1[k], p2[k]) for k in p1)
    assert not torch.equal(p1["layers.0.self_attn.q_proj.weight"], p1["layers.1.self_attn.q_proj.weight"])
    assert isinstance(tok1, ByteTokenizer) and tok1.bos_token_id == 256 and tok1.eos_token_id == 257
    outs = []
    for m in (m1, m2):
        runner = PagedRunner(m, c1, num_blocks=16)
        out, _, _ = runner.generate({0: tok1.encode("The paged cache")}, 8)
        outs.append(out[0])
    assert outs[0] == outs[1] and all(0 <= t < 512 for t in outs[0])
