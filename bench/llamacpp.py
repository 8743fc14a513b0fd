"""llama.cpp (llama-cpp-python, optional) as a baseline in `pdserve bench engine`: the same GGUF file,
the same token-id prompts and the same thread count as the engine, greedy, EOS ignored, exactly N
new tokens. `LlamaCpp` drives llama.cpp's C API through llama-cpp-python's bindings (the `Llama`
class cannot turn off the extra weight buffers, see below): the model is loaded once (mmap), a
one-sequence context serves `single` and a context with one sequence id per prompt serves
`batched` (llama.cpp's `batched` example: each prompt prefilled by its own llama_decode calls of
up to n_batch tokens, then one llama_decode per step carrying one token of every sequence). Both
contexts take n_threads = n_threads_batch = the engine's threads and llama.cpp's defaults
otherwise (flash attention auto, KV cache f16, not unified); prompts go in as token ids (no BOS
added), logits are asked only for each prompt's last position and each decoded token, argmax in
numpy, logs off as `Llama(verbose=False)` does. `single` reports the prefill seconds (the prompt up
to its first token) and decode tok/s over the tokens after the first; `batched` new tokens over
the whole wall time, as bench engine counts pdserve's. ggml's AMX matmul segfaults on some
Sapphire Rapids machines (ggml-org/llama.cpp#20824; on this project's VMs at the first decode), so
`extra_buffers_work` tries the extra buffer types (AMX, CPU repack) in a child process first and
they are turned off when it crashes. `Baseline` is bench engine's side: per alternating repeat a
batched run, pdserve's single stream (bench.engine_speed.run_engine on the first prompt) and llama.cpp's,
then the pdserve/llama.cpp ratios and greedy agreement (JSON section and printed lines), and for
each side's single-stream decode the weight bytes one step reads over the step time, as a fraction
of the memory copy bandwidth measured in the same run (bench.step_bandwidth, applied to both
engines).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

INSTALL_HINT = "pip install 'pdserve[llamacpp]' (llama-cpp-python) to add it"
PROBE_TIMEOUT_S = 120
AMX_ISSUE = "ggml-org/llama.cpp#20824"
# a llama-cpp-python built without ggml's AMX kernels keeps the CPU repack buffers (on the AMX Intel
# machine of 2026-12-03 its probe then passed and single-stream decode went from 36.6 to 48.4 tok/s)
NO_AMX_BUILD = ("CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON "
                "-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON' "
                "pip install --no-cache-dir --force-reinstall --no-deps llama-cpp-python")


def unavailable(model: str, device: str, dtype: str) -> str | None:
    """Why the llama.cpp baseline cannot run for this bench engine configuration (None: it can)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return f"llama-cpp-python is not installed; {INSTALL_HINT}"
    from model_files.gguf import is_gguf_spec

    if not is_gguf_spec(model):
        return "it needs a GGUF model (--model smollm2 or a .gguf path)"
    if not device.startswith("cpu") or dtype != "float32":
        return "it runs beside the float32 engine on cpu only"
    return None


def extra_buffers_work(gguf_path: str, threads: int) -> bool:
    """Whether llama.cpp survives a short single and batched decode with its extra weight buffer
    types, tried in a child process (`python -m bench.llamacpp GGUF THREADS`)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        return subprocess.run([sys.executable, "-m", "bench.llamacpp", gguf_path, str(threads)], cwd=root,
                              capture_output=True, timeout=PROBE_TIMEOUT_S).returncode == 0
    except subprocess.TimeoutExpired:
        return False


class LlamaCpp:
    """One GGUF file in llama.cpp: a one-sequence context and a `streams`-sequence one."""

    def __init__(self, gguf_path: str, threads: int, max_len: int, streams: int, n_batch: int = 512,
                 extra_buffers: bool = True, flash_attn: bool | None = None):
        import llama_cpp
        import numpy as np
        from llama_cpp._logger import set_verbose

        set_verbose(False)  # errors only, as Llama(verbose=False)
        llama_cpp.llama_backend_init()
        self.lib, self.np, self.n_batch, self.flash_attn = llama_cpp, np, n_batch, flash_attn
        self.contexts: list = []
        params = llama_cpp.llama_model_default_params()
        params.use_extra_bufts = extra_buffers
        self.model = llama_cpp.llama_model_load_from_file(gguf_path.encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        per_seq = -(-(max_len + 1) // 256) * 256
        self.one = self._context(per_seq, 1, threads)
        self.multi = self._context(streams * per_seq, streams, threads)
        self.batch = llama_cpp.llama_batch_init(max(n_batch, streams), 0, 1)
        self.config = {"gguf": gguf_path, "threads": threads, "n_ctx_per_sequence": per_seq,
                       "n_batch": n_batch, "streams": streams,
                       "flash_attn": "auto" if flash_attn is None else flash_attn,
                       "extra_buffer_types": extra_buffers, "llama_cpp_python": llama_cpp.__version__,
                       "system_info": llama_cpp.llama_print_system_info().decode().strip()}

    def _context(self, n_ctx: int, seqs: int, threads: int):
        cp = self.lib.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, self.n_batch, self.n_batch, seqs
        cp.n_threads = cp.n_threads_batch = threads
        if self.flash_attn is not None:
            cp.flash_attn_type = int(self.flash_attn)  # LLAMA_FLASH_ATTN_TYPE_DISABLED 0, ENABLED 1
        ctx = self.lib.llama_init_from_model(self.model, cp)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not make a context for {seqs} sequences of {n_ctx} tokens")
        self.contexts.append(ctx)
        return ctx

    def close(self) -> None:
        if self.model:
            self.lib.llama_batch_free(self.batch)
            for ctx in self.contexts:
                self.lib.llama_free(ctx)
            self.lib.llama_model_free(self.model)
            self.model, self.contexts = None, []

    def _decode(self, ctx, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode of (token, position, sequence, wants logits) entries; the argmax token
        of each entry that wanted logits, in order."""
        b = self.batch
        for k, (tok, pos, seq, out) in enumerate(entries):
            b.token[k], b.pos[k], b.n_seq_id[k], b.seq_id[k][0], b.logits[k] = tok, pos, 1, seq, out
        b.n_tokens = len(entries)
        rc = self.lib.llama_decode(ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        logits = self.lib.llama_get_logits_ith
        return [int(self.np.ctypeslib.as_array(logits(ctx, k), (self.n_vocab,)).argmax())
                for k, e in enumerate(entries) if e[3]]

    def _generate(self, ctx, prompts: list[list[int]], new_tokens: int) -> dict:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(ctx), True)
        outs: list[list[int]] = [[] for _ in prompts]
        t0 = time.perf_counter()
        for seq, p in enumerate(prompts):  # each prompt by its own calls of up to n_batch tokens
            for s in range(0, len(p), self.n_batch):
                outs[seq] += self._decode(ctx, [(p[i], i, seq, i == len(p) - 1)
                                                for i in range(s, min(len(p), s + self.n_batch))])
        t1 = time.perf_counter()
        for step in range(new_tokens - 1):  # one token of every sequence per llama_decode
            new = self._decode(ctx, [(o[-1], len(p) + step, seq, True)
                                     for seq, (p, o) in enumerate(zip(prompts, outs))])
            for o, tok in zip(outs, new):
                o.append(tok)
        t2 = time.perf_counter()
        tokens = sum(len(o) for o in outs)
        decode = len(prompts) * (new_tokens - 1) / (t2 - t1) if new_tokens > 1 else None
        return {"tokens": tokens, "seconds": t2 - t0, "tokens_per_s": tokens / (t2 - t0),
                "prefill_s": t1 - t0, "decode_s": t2 - t1, "decode_tokens_per_s": decode, "outputs": outs}

    def single(self, prompt: list[int], new_tokens: int) -> dict:
        """One sequence on the one-sequence context."""
        return self._generate(self.one, [prompt], new_tokens)

    def batched(self, prompts: list[list[int]], new_tokens: int) -> dict:
        """Every prompt at once, one sequence id each, one llama_decode per decode step."""
        return self._generate(self.multi, prompts, new_tokens)


def pdserve_single(engine_run: dict) -> dict:
    """bench.engine_speed.run_engine's result for one prompt as prefill seconds (its prefill-carrying
    steps) and decode tok/s (its decode-only steps, one token each)."""
    pre, dec = engine_run["prefill_step_ms"], engine_run["decode_step_ms"]
    return {"tokens": engine_run["tokens"], "prefill_s": pre["mean"] * pre["count"] / 1e3,
            "decode_tokens_per_s": 1e3 / dec["mean"] if dec else None,
            "decode_steps": dec["count"] if dec else 0, "outputs": engine_run["outputs"]}


def setup(model: str, device: str, dtype: str, prompts: list[list[int]], max_tokens: int, weights: str,
          threads: int) -> tuple[Baseline | None, str | None]:
    """bench engine's llama.cpp side, or None and the one-line note (printed) saying why not."""
    why = unavailable(model, device, dtype) or (None if max_tokens >= 2 else "it needs --max-tokens >= 2")
    if why:
        note = f"llama.cpp baseline: skipped, {why}"
        print(note, flush=True)
        return None, note
    from model_files.gguf import resolve_model_spec

    path = resolve_model_spec(model)
    extra = extra_buffers_work(path, threads)
    base = Baseline(path, threads, prompts, max_tokens, weights, extra)
    off = "" if extra else (f"; extra buffer types (AMX, repack) off: they crash here ({AMX_ISSUE}), so this "
                            f"llama.cpp is handicapped; a build without AMX keeps repack: {NO_AMX_BUILD}")
    print(f"llama.cpp baseline: llama-cpp-python {base.runner.config['llama_cpp_python']} on "
          f"{os.path.basename(path)}, threads {threads}, {len(prompts)} sequences in one context{off}",
          flush=True)
    return base, None


class Baseline:
    """llama.cpp beside transformers in bench engine: `repeat` once per alternating repeat,
    `report` at the end, `show` to print it."""

    def __init__(self, gguf_path: str, threads: int, prompts: list[list[int]], max_tokens: int, weights: str,
                 extra_buffers: bool = True):
        self.prompts, self.max_tokens, self.weights = prompts, max_tokens, weights
        self.runner = LlamaCpp(gguf_path, threads, max(len(p) for p in prompts) + max_tokens, len(prompts),
                               extra_buffers=extra_buffers)
        warm = [p[:16] for p in prompts[:2]]  # untimed: the first calls allocate compute buffers
        self.runner.single(warm[0], 2), self.runner.batched(warm, 2)
        self.runs: dict[str, list[dict]] = {"batched": [], "single": [], "pdserve_single": []}

    def repeat(self, r: int, repeats: int, pdserve_one) -> None:
        """llama.cpp batched, pdserve single stream (`pdserve_one()`: run_engine on prompts[0]'s
        list), llama.cpp single stream; one progress line."""
        self.runs["batched"].append(self.runner.batched(self.prompts, self.max_tokens))
        self.runs["pdserve_single"].append(pdserve_single(pdserve_one()))
        self.runs["single"].append(self.runner.single(self.prompts[0], self.max_tokens))
        b, p, s = (self.runs[k][-1] for k in ("batched", "pdserve_single", "single"))
        print(f"[{r + 1}/{repeats}] llama.cpp batched {b['tokens_per_s']:.0f} tok/s; single stream prefill "
              f"pdserve {p['prefill_s']:.2f} s, llama.cpp {s['prefill_s']:.2f} s; decode pdserve "
              f"{p['decode_tokens_per_s']:.1f} tok/s, llama.cpp {s['decode_tokens_per_s']:.1f} tok/s",
              flush=True)

    def report(self, engine_runs: list[dict], hf_outputs: list[list[int]], copy_gb_per_s: float | None = None
               ) -> dict:
        """The JSON section. engine_runs: bench engine's pdserve runs (alternating with these
        repeats, outputs still attached); hf_outputs: transformers' (float32) of the first repeat;
        copy_gb_per_s: the run's measured memory copy bandwidth (measure.machine)."""
        from bench.step_bandwidth import bandwidth_use, step_weight_bytes
        from bench.weights import first_divergence

        self.runner.close()
        med, runs = statistics.median, self.runs
        ratio = lambda xs, ys, key: [x[key] / y[key] for x, y in zip(xs, ys)]  # noqa: E731
        batched = ratio(engine_runs, runs["batched"], "tokens_per_s")
        single = ratio(runs["pdserve_single"], runs["single"], "decode_tokens_per_s")
        prefill = ratio(runs["pdserve_single"], runs["single"], "prefill_s")
        theirs, ours = runs["single"][0]["outputs"][0], runs["pdserve_single"][0]["outputs"][0]
        agree = {"pdserve_weights": self.weights,
                 "first_divergence_vs_pdserve": first_divergence(theirs, ours),
                 "first_divergence_vs_transformers_f32": first_divergence(theirs, hf_outputs[0]),
                 "batched_first_equals_single": runs["batched"][0]["outputs"][0] == theirs,
                 "batched_identical_to_pdserve": sum(a == b for a, b in zip(runs["batched"][0]["outputs"],
                                                                           engine_runs[0]["outputs"]))}
        for x in (x for xs in runs.values() for x in xs):
            x.pop("outputs", None)
        ours_tps = med(x["decode_tokens_per_s"] for x in runs["pdserve_single"])
        theirs_tps = med(x["decode_tokens_per_s"] for x in runs["single"])
        use = {"pdserve": bandwidth_use(engine_runs[0]["decode_weight_bytes"], 1 / ours_tps, copy_gb_per_s),
               "llamacpp": bandwidth_use(step_weight_bytes(self.runner.config["gguf"]), 1 / theirs_tps,
                                         copy_gb_per_s),  # a single-stream run decodes: its rates are > 0
               "memory_copy_gb_per_s": copy_gb_per_s}
        return {"config": self.runner.config, "num_prompts": len(self.prompts), "max_tokens": self.max_tokens,
                "single_prompt_tokens": len(self.prompts[0]),
                "batched_mode": "one context, one sequence id per prompt, each prompt prefilled by its own "
                                "llama_decode calls, then one llama_decode per step for all sequences",
                "batched_tokens_per_s_median": med(x["tokens_per_s"] for x in runs["batched"]),
                "single_decode_tokens_per_s_median": theirs_tps,
                "single_prefill_s_median": med(x["prefill_s"] for x in runs["single"]),
                "pdserve_single_decode_tokens_per_s_median": ours_tps,
                "pdserve_single_prefill_s_median": med(x["prefill_s"] for x in runs["pdserve_single"]),
                "ratio_batched": med(batched), "ratios_batched": batched,
                "ratio_single_decode": med(single), "ratios_single_decode": single,
                "ratio_single_prefill_time": med(prefill), "single_decode_bandwidth": use, "greedy": agree,
                "runs": runs}


def show(s: dict) -> None:
    """Print a `Baseline.report` section: the two ratios against the issue's targets, prefill, agreement."""
    g = s["greedy"]
    each = lambda key: ", ".join(f"{r:.2f}" for r in s[key])  # noqa: E731
    print(f"llama.cpp    median {s['batched_tokens_per_s_median']:9.1f} tok/s  ({s['num_prompts']} sequences "
          f"in one context); pdserve/llama.cpp {s['ratio_batched']:.2f}x (per repeat: "
          f"{each('ratios_batched')}; target >= 1.0x)")
    print(f"single stream ({s['single_prompt_tokens']}-token prompt, {s['max_tokens']} new): decode pdserve "
          f"{s['pdserve_single_decode_tokens_per_s_median']:.1f} tok/s, llama.cpp "
          f"{s['single_decode_tokens_per_s_median']:.1f} tok/s, pdserve/llama.cpp "
          f"{s['ratio_single_decode']:.2f}x (per repeat: {each('ratios_single_decode')}; target >= 0.7x); "
          f"prefill pdserve {s['pdserve_single_prefill_s_median']:.2f} s, llama.cpp "
          f"{s['single_prefill_s_median']:.2f} s")
    use = s.get("single_decode_bandwidth", {})
    if use.get("memory_copy_gb_per_s"):
        side = lambda u: (f"{u['weight_bytes_per_step'] / 1e6:.0f} MB/step = "  # noqa: E731
                          f"{u['bytes_per_step_over_step_time_gb_s']:.1f} GB/s, "
                          f"{100 * u['fraction_of_copy_bandwidth']:.0f}%")
        print(f"single-stream decode, weight bytes per step over step time, of the "
              f"{use['memory_copy_gb_per_s']:.1f} GB/s copy bandwidth: pdserve {side(use['pdserve'])}; "
              f"llama.cpp {side(use['llamacpp'])}")
    print(f"llama.cpp greedy tokens, first divergence (None: all {s['max_tokens']} equal): vs pdserve "
          f"({g['pdserve_weights']}) {g['first_divergence_vs_pdserve']}, vs transformers (f32) "
          f"{g['first_divergence_vs_transformers_f32']}; batched outputs identical to pdserve's "
          f"{g['batched_identical_to_pdserve']}/{s['num_prompts']}")


if __name__ == "__main__":  # extra_buffers_work's child: python -m bench.llamacpp GGUF THREADS
    runner = LlamaCpp(sys.argv[1], int(sys.argv[2]), 64, 2)
    runner.batched([[1] + list(range(100, 131)), [1] + list(range(200, 220))], 4)
    runner.single([1] + list(range(300, 340)), 4)
    runner.close()
