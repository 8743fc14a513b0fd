"""Weight formats against f32 on one model, behind `pdserve bench weights`.

The formats: bf16 and int8 (the float32 weights rounded), gguf (the file's own Q4_1/Q8_0 blocks,
whose values the float32 model already holds: it agrees with f32 up to summation order), gguf-q8
(the same blocks, activations rounded to int8 blocks). The text pass is one prefill forward, on
the float32 weights: for gguf and gguf-q8, the same as f32's by construction. So the text also
goes through in chunks of a decode step's rows (`decode_path`): every projection and the logits
then run through the format's own kernels, as decoding does; its greedy runs test them too.

For each format (f32 first, as the reference) the model is loaded through the engine's loader and
measured on four things. Agreement: greedy continuations of a few prompts, the first position
where a format's tokens leave f32's (None: never within the budget), and top-1 agreement
teacher-forced over the shipped text (tests/data/public_domain_text.txt): the share of positions
whose argmax equals f32's. Perplexity on that text (one full forward, exp of the mean negative log
likelihood). Speed: single-stream decode through LLMEngine (one sequence, decode-only steps
timed), median step time and tokens/s, and a batched run (`batch` sequences). Bandwidth: the
matrix bytes one single-row decode step reads (engine.weight_format) divided by the median step
time, against the copy bandwidth measured in the same run (measure.machine). One format's model is
held at a time. JSON records where it ran (convention 16).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import torch

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "public_domain_text.txt"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of",
           "Once upon a time, in a small village,"]



def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))

def text_logits(model, config, ids: list[int], rows: int | None = None) -> torch.Tensor:
    """ids (T,) through the model on a fresh pool -> logits (T, V) float32: one prefill forward
    (rows None), or chunks of `rows` tokens, each a forward of that many rows, so that every
    projection and the logits run through the decode-sized kernels (a weight format's own path)."""
    from engine.attn_metadata import AttentionMetadata
    from engine.attn_torch import Workspace
    from kvcache.storage import KVStorage

    block = 16
    n = -(-len(ids) // block)
    storage = KVStorage(config.kv_layout(block), n + 1)
    step = rows or len(ids)
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids), step):
            end = min(len(ids), start + step)
            meta = AttentionMetadata.build([list(range(n))], [end], [end - start], block)
            meta.workspace = Workspace(mirror=False, kernel=False)
            hidden = model(torch.tensor(ids[start:end]), torch.arange(start, end), storage,
                           meta)  # (t, hidden)
            out.append(model.compute_logits(hidden))  # (t, V)
    return torch.cat(out)  # (T, V)


def _engine(loaded, weights: str, blocks: int):
    from engine.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model="smollm2", weights=weights, num_blocks=blocks, num_host_blocks=0),
                     loaded=loaded)


def decode_speed(loaded, weights: str, prompt: list[int], streams: int, new_tokens: int) -> dict:
    """Median decode-only step time (ms) and tokens/s with `streams` sequences."""
    from engine.sampling import SamplingParams

    eng = _engine(loaded, weights, streams * (-(-(len(prompt) + new_tokens) // 16) + 2) + 8)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    eng.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    eng.kv.allocator.evict_cached()
    for i in range(streams):
        eng.add_request([prompt[0] + i % 7, *prompt[1:]], params)
    steps: list[float] = []
    while eng.has_work():
        t0 = time.perf_counter()
        eng.step()
        if eng.last_step_prefill_tokens == 0:
            steps.append(time.perf_counter() - t0)
    step = statistics.median(steps)
    return {"streams": streams, "decode_steps": len(steps), "step_ms_p50": step * 1e3,
            "tokens_per_s": streams / step}


def measure(weights: str, new_tokens: int, batch: int, reference: dict | None) -> dict:
    from engine import weight_format
    from engine.loader import load_model
    from engine.sampling import SamplingParams

    t0 = time.perf_counter()
    loaded = load_model("smollm2", device="cpu", backend="torch", weights=weights)
    model, config, tok = loaded
    out: dict = {"weights": weights, "load_s": time.perf_counter() - t0,
                 "decode_weight_bytes": weight_format.decode_weight_bytes(model)}
    ids = tok.encode(TEXT.read_text())
    logits = text_logits(model, config, ids)  # (T, V)
    out["text_tokens"], out["perplexity"] = len(ids), perplexity(logits, ids)
    top1 = logits.argmax(-1)
    rows = decode_rows(model)
    kernel_logits = text_logits(model, config, ids, rows)  # (T, V) through the decode-sized kernels
    out["decode_path"] = {"rows": rows, "perplexity": perplexity(kernel_logits, ids)}
    kernel_top1 = kernel_logits.argmax(-1)
    eng = _engine(loaded, weights, 256)
    greedy = [c.choices[0]["token_ids"] for c in
              eng.generate([tok.encode(p) for p in PROMPTS], SamplingParams(max_tokens=new_tokens))]
    del eng
    prompt = tok.encode(PROMPTS[0] * 8)
    out["single"] = decode_speed(loaded, weights, prompt, 1, new_tokens)
    out["batched"] = decode_speed(loaded, weights, prompt, batch, new_tokens)
    if reference is not None:
        out["top1_agreement"] = (top1 == reference["_top1"]).double().mean().item()
        same = kernel_top1 == reference["_kernel_top1"]
        out["decode_path"]["top1_agreement"] = same.double().mean().item()
        out["decode_path"]["perplexity_vs_f32"] = (out["decode_path"]["perplexity"]
                                                   / reference["decode_path"]["perplexity"])
        out["first_divergence"] = [first_divergence(g, r) for g, r in zip(greedy, reference["_greedy"])]
        out["perplexity_vs_f32"] = out["perplexity"] / reference["perplexity"]
    out["_top1"], out["_kernel_top1"], out["_greedy"] = top1, kernel_top1, greedy
    return out


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    """exp of the mean negative log likelihood of ids[1:] under logits (T, V)."""
    return math.exp(torch.nn.functional.cross_entropy(logits[:-1].double(), torch.tensor(ids[1:])).item())


def decode_rows(model) -> int:
    """Rows a decode step's projections take through the format's kernels (4 without them)."""
    from engine.cpu_gemm import Projection

    lowp = [m.lowp for m in model.modules() if isinstance(m, Projection) and m.lowp is not None]
    return min((lin.max_rows for lin in lowp), default=4)


def run(formats: tuple[str, ...] = ("f32", "bf16", "int8", "gguf", "gguf-q8"), new_tokens: int = 48,
        batch: int = 8, json_path: str | None = None) -> dict:
    from bench.step_bandwidth import bandwidth_use
    from measure import machine

    where = machine.describe()
    print(machine.summary(where), flush=True)
    bw = where["memory_copy_gb_per_s"]
    results, reference = [], None
    for fmt in dict.fromkeys(("f32", *formats)):
        print(f"[{fmt}] loading and measuring ...", flush=True)
        r = measure(fmt, new_tokens, batch, reference)
        reference = reference or r
        use = bandwidth_use(r["decode_weight_bytes"], r["single"]["step_ms_p50"] / 1e3, bw)
        r.update({k: v for k, v in use.items() if k != "weight_bytes_per_step"})  # decode_weight_bytes
        results.append(r)
        dp = r["decode_path"]
        agree = "" if fmt == "f32" else (f", top-1 {r['top1_agreement']:.4f} (decode path "
                                         f"{dp['top1_agreement']:.4f}, ppl {dp['perplexity']:.3f}), "
                                         f"first divergence {r['first_divergence']}")
        one, many = r["single"], r["batched"]
        print(f"[{fmt}] ppl {r['perplexity']:.3f}{agree}; single-stream step {one['step_ms_p50']:.1f} ms "
              f"({one['tokens_per_s']:.1f} tok/s), {batch} streams {many['step_ms_p50']:.1f} ms "
              f"({many['tokens_per_s']:.0f} tok/s); {r['decode_weight_bytes'] / 1e6:.0f} MB/step = "
              f"{r['bytes_per_step_over_step_time_gb_s']:.1f} GB/s, "
              f"{100 * r['fraction_of_copy_bandwidth']:.0f}% "
              f"of copy bandwidth", flush=True)
    for r in results:
        r.pop("_top1"), r.pop("_kernel_top1"), r.pop("_greedy")
    report = {"machine": where, "model": "smollm2", "text": TEXT.name, "prompts": PROMPTS,
              "new_tokens": new_tokens, "batch": batch, "formats": results}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {json_path}")
    return report
