"""Engine throughput benchmark: pdserve's continuous-batching engine vs Hugging Face
transformers `generate` on the same checkpoint and the same prompts, in the same run.

Models: "tiny" is a randomly initialised LlamaForCausalLM written with `save_pretrained` (the
"bench checkpoint"); "smollm2", a .gguf path or a checkpoint directory load on both sides
(transformers reads a GGUF through `gguf_file`). transformers is the peer here, so it must be
installed (the `dev` extra). Prompts are random token ids, lengths from a preset ('short'
16..128, 'long' 480..512) unless given. Both sides decode greedily for exactly `max_tokens`
tokens per prompt (EOS ignored); the report gives tokens/s, the ratio, the engine's per-step
latency percentiles (all steps, steps carrying prefill tokens, decode-only steps), and how many
prompts produced identical token ids on both sides. Each side gets one short untimed warm-up
generation first; the engine's warm-up blocks are then evicted from its prefix cache, so the
timed prompts find nothing cached. `weights` picks the engine's weight format (f32 by default).
On a GGUF model with llama-cpp-python installed, llama.cpp joins each repeat on the same file,
prompts and threads (bench.llamacpp): all prompts batched in one context, then a single stream
of the first prompt on both pdserve and llama.cpp; the report adds the pdserve/llama.cpp ratios
(batched tokens/s, single-stream decode tokens/s); without it, one line says why not.
`write_random_llama` also gives the tests their checkpoints.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
import time

import torch

PRESETS = {"short": (16, 128), "long": (480, 512)}  # prompt lengths, inclusive
# Default step budget (tokens) per model when none is given. The tiny checkpoint's steps are
# dominated by fixed per-step costs, so bigger chunks pay, and 256 keeps a prefill-carrying step
# under ~3x a decode-only one. A real model's steps are matmul-bound: a 128-token chunk keeps
# its prefill steps near a decode step's time (SmolLM2, long preset: step p99/p50 about 1.8
# against about 11 with 256) and lets more decodes ride along with prefill chunks.
DEFAULT_BUDGET = {"tiny": 256}
OTHER_BUDGET = 128


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


def _percentiles(xs: list[float]) -> dict | None:
    if not xs:
        return None
    s = sorted(xs)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": statistics.fmean(s),
            "count": len(s)}


def resolve_model(spec: str, scratch: str, seed: int) -> tuple[str, str, str | None]:
    """(engine model spec, transformers directory, transformers gguf_file or None) for a --model."""
    from model_files.gguf import is_gguf_spec, resolve_model_spec

    if spec == "tiny":
        path = write_random_llama(scratch, seed=seed)
        return path, path, None
    if is_gguf_spec(spec):
        path = resolve_model_spec(spec)
        return spec, os.path.dirname(path), os.path.basename(path)
    return spec, spec, None


def _warm_count(device: str, prompts: list) -> int:
    """Prompts in each side's untimed warm-up: two on CPU; all on cuda, whose first run of a
    batch shape compiles kernels and picks GEMM algorithms (a cold first repeat measured 4x slower)."""
    return len(prompts) if device.startswith("cuda") else 2


def run_engine(model: str, prompts: list[list[int]], max_tokens: int, block_size: int,
               max_batched_tokens: int, dtype: str, progress, device: str = "cpu",
               weights: str = "f32") -> dict:
    from engine.engine import EngineConfig, LLMEngine
    from engine.sampling import SamplingParams
    from engine.scheduler import SchedulerConfig

    blocks = sum(-(-(len(p) + max_tokens) // block_size) for p in prompts) + 16
    eng = LLMEngine(EngineConfig(model=model, dtype=dtype, block_size=block_size, num_blocks=blocks,
                                 num_host_blocks=0, device=device, weights=weights,
                                 scheduler=SchedulerConfig(max_num_batched_tokens=max_batched_tokens)))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    # warm-up, untimed; on cuda every prompt (kernels compile and libraries tune per shape)
    eng.generate(prompts[:_warm_count(device, prompts)], SamplingParams(max_tokens=2, ignore_eos=True))
    eng.kv.allocator.evict_cached()  # NOTE: else the warm-up's blocks are prefix hits for the timed run
    ids = [eng.add_request(p, params) for p in prompts]
    reqs = [eng.requests[i] for i in ids]
    steps: list[tuple[float, bool]] = []  # (milliseconds, carried prefill tokens)
    t0 = time.perf_counter()
    while eng.has_work():
        s = time.perf_counter()
        eng.step()
        steps.append(((time.perf_counter() - s) * 1e3, eng.last_step_prefill_tokens > 0))
        progress(len(steps))
    wall = time.perf_counter() - t0
    outs = [r.seqs[0].output_ids for r in reqs]
    tokens = sum(len(o) for o in outs)
    from engine.weight_format import decode_weight_bytes
    from measure.machine import engine_paths

    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "steps": len(steps),
            "paths": engine_paths(eng), "decode_weight_bytes": decode_weight_bytes(eng.model),
            "step_ms": _percentiles([ms for ms, _ in steps]),
            "prefill_step_ms": _percentiles([ms for ms, prefill in steps if prefill]),
            "decode_step_ms": _percentiles([ms for ms, prefill in steps if not prefill]),
            "prefix_hit_tokens": eng.kv.prefix_hit_tokens, "outputs": outs}


def run_hf(directory: str, prompts: list[list[int]], max_tokens: int, gguf_file: str | None = None,
           dtype: str = "float32", device: str = "cpu") -> dict:
    from transformers import AutoModelForCausalLM

    extra = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype), **extra)
    model = model.eval().to(device)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    warm = _warm_count(device, prompts)
    with torch.inference_mode():  # warm-up, untimed
        model.generate(input_ids=ids[:warm], attention_mask=mask[:warm], max_new_tokens=2, do_sample=False,
                       pad_token_id=0)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        if out.is_cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    gen = out[:, width:].tolist()
    tokens = sum(len(g) for g in gen)
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "outputs": gen}


def _vocab_size(model: str) -> int:
    from engine.loader import read_config
    from model_files.gguf import GGUFFile, is_gguf_spec, resolve_model_spec

    if is_gguf_spec(model):
        return int(GGUFFile(resolve_model_spec(model)).hf_config()["vocab_size"])
    return read_config(model).vocab_size


def run(num_prompts: int = 32, max_tokens: int = 64, min_prompt: int | None = None,
        max_prompt: int | None = None, block_size: int = 16, seed: int = 0, repeats: int = 3,
        json_path: str | None = None, model: str = "tiny", preset: str = "short",
        max_batched_tokens: int | None = None, dtype: str = "float32", device: str = "cpu",
        weights: str = "f32", llamacpp: bool = True) -> dict:
    """Alternate engine and transformers runs `repeats` times; report medians and the median ratio.
    min_prompt/max_prompt override the preset's prompt lengths; max_batched_tokens None picks
    the model's default (DEFAULT_BUDGET). device: both sides' ('cuda': the engine's attention
    backend resolves to Triton). weights: the engine's weight format (engine.weight_format).
    llamacpp: add llama.cpp on the same GGUF (bench.llamacpp) to each repeat when it can run."""
    from tqdm import tqdm

    low, high = PRESETS[preset]
    if max_batched_tokens is None:
        max_batched_tokens = DEFAULT_BUDGET.get(model, OTHER_BUDGET)
    min_prompt = low if min_prompt is None else min_prompt
    max_prompt = high if max_prompt is None else max_prompt
    from measure.machine import describe, summary

    where = describe()
    print(summary(where), flush=True)
    load = {"start": os.getloadavg()}  # other processes share the CPU: the 1/5/15-minute load averages
    engine_runs, hf_runs = [], []
    with tempfile.TemporaryDirectory() as d:
        engine_model, hf_dir, gguf_file = resolve_model(model, d, seed)
        vocab = _vocab_size(engine_model)
        rng = random.Random(seed)
        prompts = [[1] + [rng.randrange(3, vocab) for _ in range(rng.randint(min_prompt, max_prompt) - 1)]
                   for _ in range(num_prompts)]
        print(f"model {model}; {num_prompts} prompts of {min_prompt}..{max_prompt} tokens, {max_tokens} new "
              f"tokens each, {dtype} on {device}, step budget {max_batched_tokens} tokens, torch threads "
              f"{torch.get_num_threads()}, {repeats} alternating repeats; pdserve weights {weights}")
        from bench import llamacpp as lcpp

        base, note = lcpp.setup(model, device, dtype, prompts, max_tokens, weights, torch.get_num_threads()) \
            if llamacpp else (None, "llama.cpp baseline: not asked for")
        for r in range(repeats):
            bar = tqdm(desc=f"[{r + 1}/{repeats}] pdserve engine steps", unit="step")
            tick = lambda n, b=bar: b.update(1)  # noqa: E731
            engine_runs.append(run_engine(engine_model, prompts, max_tokens, block_size, max_batched_tokens,
                                          dtype, tick, device, weights))
            bar.close()
            print(f"[{r + 1}/{repeats}] transformers generate (one padded batch) ...", flush=True)
            hf_runs.append(run_hf(hf_dir, prompts, max_tokens, gguf_file, dtype, device))
            print(f"[{r + 1}/{repeats}] pdserve {engine_runs[-1]['tokens_per_s']:.0f} tok/s, "
                  f"transformers {hf_runs[-1]['tokens_per_s']:.0f} tok/s", flush=True)
            if base:
                base.repeat(r, repeats, lambda: run_engine(engine_model, prompts[:1], max_tokens, block_size,
                                                           max_batched_tokens, dtype, lambda n: None, device,
                                                           weights))
    same = sum(a == b for a, b in zip(engine_runs[0]["outputs"], hf_runs[0]["outputs"]))
    llama = base.report(engine_runs, hf_runs[0]["outputs"], where.get("memory_copy_gb_per_s")) if base \
        else {"skipped": note}
    for x in engine_runs + hf_runs:
        x.pop("outputs")
    med = lambda runs: statistics.median(x["tokens_per_s"] for x in runs)  # noqa: E731
    ratios = [e["tokens_per_s"] / h["tokens_per_s"] for e, h in zip(engine_runs, hf_runs)]
    where["paths"] = engine_runs[0]["paths"]
    where["load_average"] = {**load, "end": os.getloadavg()}
    result = {"machine": where, "config": {"model": model, "preset": preset, "num_prompts": num_prompts,
                         "max_tokens": max_tokens, "prompt_len": [min_prompt, max_prompt],
                         "block_size": block_size, "max_batched_tokens": max_batched_tokens, "dtype": dtype,
                         "weights": weights,
                         "device": device, "torch_threads": torch.get_num_threads(), "repeats": repeats},
              "pdserve": {"tokens_per_s_median": med(engine_runs), "runs": engine_runs},
              "transformers": {"tokens_per_s_median": med(hf_runs), "runs": hf_runs},
              "speedup_vs_transformers": statistics.median(ratios), "ratios": ratios,
              "identical_outputs": same, "num_prompts": num_prompts, "llamacpp": llama}
    e0 = sorted(engine_runs, key=lambda x: x["tokens_per_s"])[len(engine_runs) // 2]
    step, pre, dec = e0["step_ms"], e0["prefill_step_ms"], e0["decode_step_ms"]
    print(f"pdserve      median {med(engine_runs):9.1f} tok/s  (step p50 {step['p50']:.1f} ms, "
          f"p99 {step['p99']:.1f} ms, p99/p50 {step['p99'] / step['p50']:.2f})")
    for name, pct in (("prefill-carrying", pre), ("decode-only", dec)):
        if pct:
            print(f"  {name:17s} steps {pct['count']:4d}: p50 {pct['p50']:.1f} ms, p90 {pct['p90']:.1f} ms, "
                  f"p99 {pct['p99']:.1f} ms")
    print(f"transformers median {med(hf_runs):9.1f} tok/s")
    print(f"median ratio {result['speedup_vs_transformers']:.2f}x (per repeat: "
          f"{', '.join(f'{r:.2f}' for r in ratios)}); identical greedy outputs: {same}/{num_prompts}")
    if base:
        lcpp.show(llama)
    print(f"load average (1, 5, 15 min) at start {', '.join(f'{x:.2f}' for x in load['start'])}, at end "
          f"{', '.join(f'{x:.2f}' for x in where['load_average']['end'])} on {os.cpu_count()} cpus")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
    return result
