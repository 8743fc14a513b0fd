"""The Triton paged-attention kernel benchmark behind `pdserve bench kernels`: the KV store, decode
and prefill kernels against the torch reference backend on realistic Llama-style shapes, on CUDA.
Each case records the median time of both, the speedup, the largest absolute difference from the
reference and, for decode, the effective bandwidth of the K/V bytes read, also as a fraction of
the device's copy bandwidth measured in the same run. Without CUDA it says so,
runs one tiny case per kernel under TRITON_INTERPRET=1 through the same code (a smoke test: those
times mean nothing) and still writes the JSON. Torch, Triton and the engine are imported lazily.
"""

from __future__ import annotations

import json
import sys

# (num_seqs, context, q_heads, kv_heads, head_dim, block_size)
DECODE_CASES = [(64, 2048, 32, 8, 128, 16), (256, 1024, 32, 8, 128, 16), (8, 8192, 32, 8, 128, 16),
                (32, 4096, 32, 32, 128, 16), (64, 2048, 32, 8, 64, 32)]
# (num_seqs, new tokens, cached prefix, q_heads, kv_heads, head_dim, block_size)
PREFILL_CASES = [(4, 1024, 0, 32, 8, 128, 16), (8, 512, 1536, 32, 8, 128, 16), (1, 4096, 0, 32, 8, 128, 16)]
# (tokens, kv_heads, head_dim, block_size)
STORE_CASES = [(8192, 8, 128, 16), (64, 8, 128, 16)]
# Without CUDA: one tiny case each, run by the Triton interpreter.
CPU_JOBS = [("store_kv", (8, 2, 32, 4)), ("decode", (2, 40, 4, 2, 32, 16)),
            ("prefill", (1, 20, 8, 4, 2, 32, 16))]


def _time_ms(fn, fn_args: tuple, iters: int, warmup: int) -> float:
    """Median CUDA-event time of fn(*fn_args) in milliseconds (wall clock on CPU)."""
    import time

    import torch
    for _ in range(warmup):
        fn(*fn_args)
    times = []
    for _ in range(iters):
        if not torch.cuda.is_available():
            t0 = time.perf_counter()
            fn(*fn_args)
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*fn_args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def copy_gb_per_s(device: str, nbytes: int = 1 << 30, iters: int = 10) -> float:
    """The device's measured copy bandwidth: a large device-to-device copy, counting the bytes
    read plus the bytes written (the ceiling a KV-reading kernel is quoted against)."""
    import torch

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)  # not zeros: see METHOD
    dst = torch.empty_like(src)
    ms = _time_ms(dst.copy_, (src,), iters, 3)
    return 2 * nbytes / ms / 1e6


def _setup(seq_lens, query_lens, q_heads, kv_heads, head_dim, block_size, dtype, device):
    """A 2-layer pool (layer 1's strided views), shuffled block tables, metadata and queries."""
    import torch

    from engine.attn_metadata import AttentionMetadata
    from kvcache.storage import KVLayout, KVStorage, dtype_name
    need = [-(-n // block_size) for n in seq_lens]
    storage = KVStorage(KVLayout(2, kv_heads, head_dim, block_size, dtype_name(dtype)), sum(need) + 1, device)
    storage.data.normal_()
    perm, tables, at = torch.randperm(sum(need)).tolist(), [], 0
    for k in need:
        tables.append(perm[at:at + k])
        at += k
    meta = AttentionMetadata.build(tables, seq_lens, query_lens, block_size, device)
    q = torch.randn(sum(query_lens), q_heads, head_dim, device=device, dtype=dtype)
    k_cache, v_cache = storage.layer_view(1)
    return q, k_cache, v_cache, meta


def _row(kernel, fields, triton_ms, torch_ms, err, extra=None):
    row = {"kernel": kernel, **fields, "triton_ms": round(triton_ms, 4), "torch_ms": round(torch_ms, 4),
           "speedup": round(torch_ms / triton_ms, 2), "max_abs_err": err}
    row.update(extra or {})
    return row


def _bench_case(kernel: str, case: tuple, dtype, device: str, iters: int, warmup: int) -> dict:
    import torch

    from engine import attn_torch, attn_triton
    dname = str(dtype).removeprefix("torch.")
    if kernel == "store_kv":
        T, Hkv, D, B = case
        _, k_cache, v_cache, meta = _setup([T], [T], Hkv, Hkv, D, B, dtype, device)
        key, value = (torch.randn(T, Hkv, D, device=device, dtype=dtype) for _ in range(2))
        fn_args = (key, value, k_cache, v_cache, meta.slot_mapping)
        tri = _time_ms(attn_triton.store_kv, fn_args, iters, warmup)
        ref = _time_ms(attn_torch.store_kv, fn_args, iters, warmup)
        k_cache.zero_()
        v_cache.zero_()
        attn_triton.store_kv(*fn_args)
        blocks, offs = meta.slot_mapping // B, meta.slot_mapping % B
        err = max(float((k_cache[blocks, offs] - key).abs().max()),
                  float((v_cache[blocks, offs] - value).abs().max()))  # stored exactly: 0.0
        fields = dict(tokens=T, kv_heads=Hkv, head_dim=D, block_size=B, dtype=dname)
        return _row(kernel, fields, tri, ref, err)
    if kernel == "decode":
        S, ctx, Hq, Hkv, D, B = case
        seq_lens, query_lens = [ctx] * S, [1] * S
        fields = dict(num_seqs=S, context=ctx, q_heads=Hq, kv_heads=Hkv, head_dim=D, block_size=B,
                      dtype=dname)
    else:
        S, ql, prefix, Hq, Hkv, D, B = case
        seq_lens, query_lens = [prefix + ql] * S, [ql] * S
        fields = dict(num_seqs=S, q_len=ql, prefix=prefix, q_heads=Hq, kv_heads=Hkv, head_dim=D,
                      block_size=B, dtype=dname)
    q, k_cache, v_cache, meta = _setup(seq_lens, query_lens, Hq, Hkv, D, B, dtype, device)
    fn_args = (q, k_cache, v_cache, meta, D ** -0.5)
    out = attn_triton.paged_attention(*fn_args).float()
    err = float(f"{float((out - attn_torch.paged_attention(*fn_args).float()).abs().max()):.3g}")
    tri = _time_ms(attn_triton.paged_attention, fn_args, iters, warmup)
    ref = _time_ms(attn_torch.paged_attention, fn_args, max(3, iters // 4), 1)
    extra = None
    if kernel == "decode":
        kv_bytes = 2 * sum(seq_lens) * Hkv * D * q.element_size()
        extra = {"triton_kv_gb_per_s": round(kv_bytes / tri / 1e6, 1)}
    return _row(kernel, fields, tri, ref, err, extra)


def run(dtype_name: str = "float16", iters: int = 20, warmup: int = 3, quick: bool = False,
        json_path: str | None = None) -> dict:
    """Time every case (the first of each kernel when `quick`), print a table, write
    {"device", "dtype", "results", ["note"]} to `json_path` when given, and return it."""
    import os

    import torch
    cuda = torch.cuda.is_available()
    note = None
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before engine.attn_triton imports triton
        note = ("no CUDA: nothing timed; one tiny case per kernel ran under TRITON_INTERPRET=1 as a "
                "smoke test (its times are meaningless)")
        print(note)
    from tqdm import tqdm
    dtype = getattr(torch, dtype_name) if cuda else torch.float32
    torch.manual_seed(0)
    pick = (lambda cases: cases[:1]) if quick else (lambda cases: cases)
    jobs = [("store_kv", c) for c in pick(STORE_CASES)] + [("decode", c) for c in pick(DECODE_CASES)] \
        + [("prefill", c) for c in pick(PREFILL_CASES)]
    if not cuda:
        jobs, iters, warmup = CPU_JOBS, 1, 0
    results, copy_bw = [], copy_gb_per_s("cuda") if cuda else None
    for kernel, case in tqdm(jobs, desc="kernels", file=sys.stderr):
        results.append(_bench_case(kernel, case, dtype, "cuda" if cuda else "cpu", iters, warmup))
        if cuda:
            torch.cuda.empty_cache()
    print(f"{'kernel':9s} {'shape':64s} {'triton ms':>10s} {'torch ms':>10s} {'speedup':>8s}")
    for r in results:
        shape = ",".join(f"{k}={v}" for k, v in r.items()
                         if k not in ("kernel", "triton_ms", "torch_ms", "speedup", "dtype"))
        print(f"{r['kernel']:9s} {shape:64s} {r['triton_ms']:10.3f} {r['torch_ms']:10.3f} "
              f"{r['speedup']:8.2f}")
    if copy_bw:
        for r in results:
            if "triton_kv_gb_per_s" in r:
                r["fraction_of_copy_bw"] = round(r["triton_kv_gb_per_s"] / copy_bw, 3)
        decode = [r for r in results if "fraction_of_copy_bw" in r]
        print(f"device copy bandwidth (read + write) {copy_bw:.0f} GB/s; Triton decode K/V reads at "
              + ", ".join(f"{r['fraction_of_copy_bw']:.2f} (S={r['num_seqs']}, ctx={r['context']})"
                          for r in decode) + " of it")
    body = {"device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)",
            "dtype": str(dtype).removeprefix("torch."), "copy_gb_per_s": copy_bw, "results": results}
    if note:
        body["note"] = note
    if json_path:
        with open(json_path, "w") as f:
            json.dump(body, f, indent=2)
        print(f"wrote {json_path}")
    return body
