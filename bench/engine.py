"""Engine throughput benchmark: pdserve's continuous-batching engine vs Hugging Face
transformers `generate` on the same checkpoint and the same prompts, in the same run.

The checkpoint is a randomly initialised LlamaForCausalLM written with `save_pretrained`
(transformers is the peer here, so it must be installed: the `dev` extra). Both sides decode
greedily for exactly `max_tokens` tokens per prompt (EOS ignored); the report gives tokens/s,
the ratio, the engine's per-step latency percentiles, and how many prompts produced identical
token ids on both sides. Each side gets one short untimed warm-up generation first.
`write_random_llama` also gives the tests their small random checkpoints.
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
    eng.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up, untimed
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
    with torch.inference_mode():  # warm-up, untimed
        model.generate(input_ids=ids[:2], attention_mask=mask[:2], max_new_tokens=2, do_sample=False,
                       pad_token_id=0)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    wall = time.perf_counter() - t0
    gen = out[:, width:].tolist()
    tokens = sum(len(g) for g in gen)
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "outputs": gen}


def run(num_prompts: int = 32, max_tokens: int = 64, min_prompt: int = 16, max_prompt: int = 128,
        block_size: int = 16, seed: int = 0, repeats: int = 3, json_path: str | None = None) -> dict:
    """Alternate engine and transformers runs `repeats` times; report medians and the median ratio."""
    from tqdm import tqdm

    rng = random.Random(seed)
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(rng.randint(min_prompt, max_prompt) - 1)]
               for _ in range(num_prompts)]
    engine_runs, hf_runs = [], []
    with tempfile.TemporaryDirectory() as d:
        ckpt = write_random_llama(d, seed=seed)
        print(f"checkpoint: random LlamaForCausalLM; {num_prompts} prompts of {min_prompt}..{max_prompt} "
              f"tokens, {max_tokens} new tokens each, torch threads {torch.get_num_threads()}, "
              f"{repeats} alternating repeats")
        for r in range(repeats):
            bar = tqdm(desc=f"[{r + 1}/{repeats}] pdserve engine steps", unit="step")
            tick = lambda n, b=bar: b.update(1)  # noqa: E731
            engine_runs.append(run_engine(ckpt, prompts, max_tokens, block_size, tick))
            bar.close()
            print(f"[{r + 1}/{repeats}] transformers generate (one padded batch) ...", flush=True)
            hf_runs.append(run_hf(ckpt, prompts, max_tokens))
            print(f"[{r + 1}/{repeats}] pdserve {engine_runs[-1]['tokens_per_s']:.0f} tok/s, "
                  f"transformers {hf_runs[-1]['tokens_per_s']:.0f} tok/s", flush=True)
    same = sum(a == b for a, b in zip(engine_runs[0]["outputs"], hf_runs[0]["outputs"]))
    for x in engine_runs + hf_runs:
        x.pop("outputs")
    med = lambda runs: statistics.median(x["tokens_per_s"] for x in runs)  # noqa: E731
    ratios = [e["tokens_per_s"] / h["tokens_per_s"] for e, h in zip(engine_runs, hf_runs)]
    result = {"config": {"num_prompts": num_prompts, "max_tokens": max_tokens,
                         "prompt_len": [min_prompt, max_prompt], "block_size": block_size,
                         "dtype": "float32", "device": "cpu", "torch_threads": torch.get_num_threads(),
                         "repeats": repeats},
              "pdserve": {"tokens_per_s_median": med(engine_runs), "runs": engine_runs},
              "transformers": {"tokens_per_s_median": med(hf_runs), "runs": hf_runs},
              "speedup_vs_transformers": statistics.median(ratios), "ratios": ratios,
              "identical_outputs": same, "num_prompts": num_prompts}
    e0 = engine_runs[len(engine_runs) // 2]
    print(f"pdserve      median {med(engine_runs):9.1f} tok/s  (step p50 {e0['step_ms']['p50']:.1f} ms, "
          f"p99 {e0['step_ms']['p99']:.1f} ms)")
    print(f"transformers median {med(hf_runs):9.1f} tok/s")
    print(f"median ratio {result['speedup_vs_transformers']:.2f}x (per repeat: "
          f"{', '.join(f'{r:.2f}' for r in ratios)}); identical greedy outputs: {same}/{num_prompts}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
    return result
