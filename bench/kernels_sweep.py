"""Launch-parameter sweep of the Triton attention kernels: `python -m bench.kernels_sweep --json F`.

On `bench.kernels`' shapes it times paged decode over (block_n, context splits) and paged prefill
over (block_m, block_n, num_warps, num_stages). Each variant is checked against the default
launch's output before it is timed. Decode rows give the K/V read bandwidth as a fraction of the
device's copy bandwidth, measured in the same run; prefill rows give TFLOP/s of the causal work.
The row the engine's heuristics pick today is marked `default`, so the JSON shows how far that
choice is from the best measured one. Without CUDA it runs one tiny case of each kernel under
TRITON_INTERPRET=1, as a smoke test whose times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial

import torch

TINY_DECODE = [(2, 40, 4, 2, 32, 16)]
TINY_PREFILL = [(1, 20, 8, 4, 2, 32, 16)]


def _decode_rows(cases, dtype, device, iters, copy_bw):
    from bench.kernels import _setup, _time_ms
    from engine import attn_triton

    rows = []
    for S, ctx, Hq, Hkv, D, B in cases:
        q, kc, vc, meta = _setup([ctx] * S, [1] * S, Hq, Hkv, D, B, dtype, device)
        ref = attn_triton.paged_decode(q, kc, vc, meta, D ** -0.5).float()  # (S, Hq, D)
        default = (attn_triton.decode_block_n(D), attn_triton._decode_splits(q.device, S, Hkv, ctx))
        kv_bytes = 2 * S * ctx * Hkv * D * q.element_size()
        for bn in (32, 64, 128) if device == "cuda" else (16,):
            for splits in sorted({1, 2, 4, 8, 16, 32, default[1]}) if device == "cuda" else (1, 2):
                if splits > 1 and ctx < 2 * splits * bn:
                    continue
                fn = partial(attn_triton.paged_decode, q, kc, vc, meta, D ** -0.5, num_splits=splits,
                             block_n=bn)
                err = float((fn().float() - ref).abs().max())
                ms = _time_ms(fn, (), iters, 3)
                gbps = kv_bytes / ms / 1e6
                rows.append({"kernel": "decode", "num_seqs": S, "context": ctx, "q_heads": Hq,
                             "kv_heads": Hkv, "head_dim": D, "block_size": B, "block_n": bn, "splits": splits,
                             "ms": ms,
                             "kv_gb_per_s": gbps, "fraction_of_copy_bw": gbps / copy_bw if copy_bw else None,
                             "max_abs_diff": err, "default": (bn, splits) == default})
        del q, kc, vc, meta
    return rows


def _prefill_rows(cases, dtype, device, iters):
    from bench.kernels import _setup, _time_ms
    from engine import attn_triton

    rows = []
    for S, ql, prefix, Hq, Hkv, D, B in cases:
        q, kc, vc, meta = _setup([prefix + ql] * S, [ql] * S, Hq, Hkv, D, B, dtype, device)
        ref = attn_triton.paged_prefill(q, kc, vc, meta, D ** -0.5).float()  # (T, Hq, D)
        keys = sum(prefix + i + 1 for i in range(ql)) * S  # keys attended, summed over query rows
        flops = 4 * keys * Hq * D
        grid = [(bm, bn, w, st) for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3)]
        for bm, bn, warps, stages in grid if device == "cuda" else [(16, 16, 4, 2)]:
            fn = partial(attn_triton.paged_prefill, q, kc, vc, meta, D ** -0.5, block_m=bm, block_n=bn,
                         num_warps=warps, num_stages=stages)
            row = {"kernel": "prefill", "num_seqs": S, "q_len": ql, "prefix": prefix, "q_heads": Hq,
                   "kv_heads": Hkv, "head_dim": D, "block_size": B, "block_m": bm, "block_n": bn,
                   "num_warps": warps, "num_stages": stages,
                   "default": (bm, bn, warps, stages) == (64, 64, 4, 2)}
            try:
                row["max_abs_diff"] = float((fn().float() - ref).abs().max())
                row["ms"] = _time_ms(fn, (), iters, 3)
                row["tflop_per_s"] = flops / row["ms"] / 1e9
            except Exception as e:  # noqa: BLE001 (a variant that does not fit the chip: shared memory)
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            rows.append(row)
        del q, kc, vc, meta
    return rows


def _best(rows, key, bigger):
    out = {}
    for r in rows:
        if r.get(key) is None:
            continue
        shape = tuple(r[k] for k in ("kernel", "num_seqs", "context" if r["kernel"] == "decode" else "q_len"))
        group = out.setdefault(shape, {"best": None, "default": None})
        if group["best"] is None or (r[key] > group["best"][key]) == bigger:
            group["best"] = r
        if r["default"]:
            group["default"] = r
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write every row here")
    p.add_argument("--dtype", default="bfloat16", choices=("float16", "bfloat16"))
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from bench.kernels import DECODE_CASES, PREFILL_CASES, copy_gb_per_s

    device = "cuda" if cuda else "cpu"
    dtype = getattr(torch, args.dtype) if cuda else torch.float32
    iters = args.iters if cuda else 1
    torch.manual_seed(0)
    copy_bw = copy_gb_per_s("cuda") if cuda else None
    def dump(rows):  # after each kernel, so a run cut short keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)",
                           "dtype": str(dtype).removeprefix("torch."), "copy_gb_per_s": copy_bw,
                           "rows": rows}, f, indent=1)

    rows = _decode_rows(DECODE_CASES if cuda else TINY_DECODE, dtype, device, iters, copy_bw)
    dump(rows)
    rows += _prefill_rows(PREFILL_CASES if cuda else TINY_PREFILL, dtype, device, iters)
    dump(rows)
    for shape, g in {**_best([r for r in rows if r["kernel"] == "decode"], "ms", False),
                     **_best([r for r in rows if r["kernel"] == "prefill"], "ms", False)}.items():
        b, d = g["best"], g["default"]
        params = ("block_n", "splits") if shape[0] == "decode" else \
            ("block_m", "block_n", "num_warps", "num_stages")
        print(f"{shape}: best {b['ms']:.4f} ms {[b[k] for k in params]}, default "
              f"{d['ms'] if d and d.get('ms') else float('nan'):.4f} ms", file=sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
