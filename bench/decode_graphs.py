"""Decode step time with CUDA graphs against eager: `python -m bench.decode_graphs --model DIR --json F`.

For each batch size, S sequences of `--context` tokens sit in a pool filled with random K/V; one
decode step (every layer, then the logits) runs eagerly (the engine's path without graphs) and
as a replay of engine.cuda_graphs' captured bucket, alternating, `--iters` each; the table gives
the median milliseconds of each, their ratio, and the largest logit difference between the two
(the same math; the graph's decode kernel splits the context for the table's full width, so the
float sums may differ in order). Without CUDA it runs the static path under TRITON_INTERPRET=1 on
the given model, as a smoke test whose times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def _ms(fn, cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def run(model_dir: str, dtype: str, batches: list[int], context: int, block_size: int, iters: int) -> dict:
    from engine.attention import get_backend
    from engine.attn_metadata import AttentionMetadata
    from engine.cuda_graphs import DecodeGraphs
    from engine.loader import load_model
    from kvcache.storage import KVStorage

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model, config, _ = load_model(model_dir, device=device, dtype=dtype if cuda else "float32",
                                  backend=get_backend("triton"))
    B, width = block_size, -(-config.max_position_embeddings // block_size)
    per_seq = -(-(context + 1) // B)
    num_blocks = max(batches) * per_seq
    kv_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    storage = KVStorage(config.kv_layout(B, kv_dtype, "bench"), num_blocks, device, null_block=True)
    storage.data.normal_()  # (N, L, 2, B, H, D)
    graphs = DecodeGraphs(model, storage, B, min(width, num_blocks), max(batches), capture=cuda)
    t0 = time.perf_counter()
    captured = graphs.capture_all()
    capture_s = time.perf_counter() - t0
    rows = []
    for S in batches:
        tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(S)]
        meta = AttentionMetadata.build(tables, [context + 1] * S, [1] * S, B, device,
                                       null_block=storage.null_block_id)
        ids = torch.randint(3, config.vocab_size, (S,), device=device)

        def eager(ids=ids, meta=meta):
            with torch.inference_mode():
                return model.compute_logits(model.forward(ids, meta.positions, storage, meta)).float()

        def graph(ids=ids, meta=meta):
            return graphs.run(ids, meta, graphs.bucket(meta))

        diff = float((eager() - graph()).abs().max())
        e_ms, g_ms = [], []
        for _ in range(iters):  # alternating, so drift hits both alike
            e_ms.append(_ms(eager, cuda))
            g_ms.append(_ms(graph, cuda))
        e, g = statistics.median(e_ms), statistics.median(g_ms)
        rows.append({"batch": S, "bucket": graphs.bucket(meta), "context": context, "eager_ms": e,
                     "graph_ms": g, "speedup": e / g, "max_abs_logit_diff": diff})
        print(f"batch {S:4d} (bucket {rows[-1]['bucket']}), context {context}: eager {e:.3f} ms, "
              f"graph {g:.3f} ms, {e / g:.2f}x; max |logit diff| {diff:.2e}", flush=True)
    return {"device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter, static path)",
            "model": model_dir, "dtype": kv_dtype, "layers": config.num_layers, "block_size": B,
            "captured": captured, "capture_s": capture_s, "buckets": list(graphs.buckets), "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True,
                   help="a checkpoint directory (bench.engine_speed.write_random_llama)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    out = run(args.model, args.dtype, [int(b) for b in args.batches.split(",")], args.context,
              args.block_size, args.iters)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
