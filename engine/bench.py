"""Engine throughput benchmark: pdserve's continuous-batching engine vs Hugging Face
transformers `generate` on the same checkpoint and the same prompts, in the same run.

The checkpoint is a randomly initialised LlamaForCausalLM written with `save_pretrained`
(transformers is the peer here, so it must be installed: the `dev` extra). Both sides decode
greedily for exactly `max_tokens` tokens per prompt (EOS ignored); the report gives tokens/s,
the ratio, the engine's per-step latency percentiles, and how many prompts produced identical
token ids on both sides.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time

import torch


def write_random_llama(path: str, seed: int = 0, vocab: int = 512, hidden: int = 128, layers: int = 4,
                       heads: int = 4, kv_heads: int = 2, intermediate: int = 352) -> str:
    """Save a random LlamaForCausalLM (safetensors) to `path` and return it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0, initializer_range=0.1)
    LlamaForCausalLM(cfg).eval().save_pretrained(path, safe_serialization=True)
    return path


def _percentiles(xs: list[float]) -> dict:
    s = sorted(xs)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": statistics.fmean(s)}


def run_engine(ckpt: str, prompts: list[list[int]], max_tokens: int, block_size: int, progress) -> dict:
    from engine.engine import EngineConfig, LLMEngine
    from engine.sampling import SamplingParams

    eng = LLMEngine(EngineConfig(model=ckpt, block_size=block_size, num_blocks=4096, num_host_blocks=0))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = [eng.add_request(p, params) for p in prompts]
    reqs = [eng.requests[i] for i in ids]
    steps: list[float] = []
    t0 = time.perf_counter()
    while eng.has_work():
        s = time.perf_counter()
        eng.step()
        steps.append((time.perf_counter() - s) * 1e3)
        progress(len(steps))
    wall = time.perf_counter() - t0
    outs = [r.seqs[0].output_ids for r in reqs]
    tokens = sum(len(o) for o in outs)
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "steps": len(steps),
            "step_ms": _percentiles(steps), "outputs": outs}


def run_hf(ckpt: str, prompts: list[list[int]], max_tokens: int) -> dict:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    wall = time.perf_counter() - t0
    gen = out[:, width:].tolist()
    tokens = sum(len(g) for g in gen)
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "outputs": gen}


def run(num_prompts: int = 32, max_tokens: int = 64, min_prompt: int = 16, max_prompt: int = 128,
        block_size: int = 16, seed: int = 0, json_path: str | None = None) -> dict:
    from tqdm import tqdm

    rng = random.Random(seed)
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(rng.randint(min_prompt, max_prompt) - 1)]
               for _ in range(num_prompts)]
    with tempfile.TemporaryDirectory() as d:
        ckpt = write_random_llama(d, seed=seed)
        print(f"checkpoint: random LlamaForCausalLM; {num_prompts} prompts of {min_prompt}..{max_prompt} "
              f"tokens, {max_tokens} new tokens each, torch threads {torch.get_num_threads()}")
        bar = tqdm(desc="pdserve engine steps", unit="step")
        eng = run_engine(ckpt, prompts, max_tokens, block_size, lambda n: bar.update(1))
        bar.close()
        print("transformers generate (one padded batch) ...", flush=True)
        hf = run_hf(ckpt, prompts, max_tokens)
    same = sum(a == b for a, b in zip(eng.pop("outputs"), hf.pop("outputs")))
    result = {"config": {"num_prompts": num_prompts, "max_tokens": max_tokens,
                         "prompt_len": [min_prompt, max_prompt], "block_size": block_size,
                         "dtype": "float32", "device": "cpu", "torch_threads": torch.get_num_threads()},
              "pdserve": eng, "transformers": hf,
              "speedup_vs_transformers": eng["tokens_per_s"] / hf["tokens_per_s"],
              "identical_outputs": same, "num_prompts": num_prompts}
    print(f"pdserve      {eng['tokens_per_s']:9.1f} tok/s  ({eng['steps']} steps, "
          f"step p50 {eng['step_ms']['p50']:.1f} ms, p99 {eng['step_ms']['p99']:.1f} ms)")
    print(f"transformers {hf['tokens_per_s']:9.1f} tok/s")
    print(f"ratio {result['speedup_vs_transformers']:.2f}x; identical greedy outputs: {same}/{num_prompts}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
    return result
