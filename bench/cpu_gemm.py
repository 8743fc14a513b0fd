"""CPU projection benchmark: torch's `F.linear` (MKL sgemm) against engine.cpu_gemm's oneDNN call
on a weight packed once, for every projection shape of a model (fused qkv, o, fused gate/up,
down, logits) at the row counts engine steps see (a decode batch of 1..32, prefill chunks of
128..512). Both sides run in float32 on one torch thread by default, alternating, in the same
run; the report gives the median time per call, GFLOP/s, the ratio, whether `pack` would pack
that weight by default, and the largest difference between the two results. Models: 'tiny' (the
bench checkpoint's shape) and 'smollm2' (SmolLM2-135M's shape); no weights are loaded, the
shapes come from the configs and the weights are random.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
import torch.nn.functional as F

from engine.cpu_gemm import MIN_PACKED_ELEMENTS, PackedLinear, available

SHAPES = {  # model -> (hidden, heads, kv heads, head dim, intermediate, vocab)
    "tiny": (128, 4, 2, 32, 352, 512),
    "smollm2": (576, 9, 3, 64, 1536, 49152),
}
ROWS = (1, 8, 32, 128, 512)


def projections(model: str) -> dict[str, tuple[int, int]]:
    """name -> (out, in) of each weight of one layer, plus the logits."""
    h, hq, hkv, d, inter, vocab = SHAPES[model]
    return {"qkv": ((hq + 2 * hkv) * d, h), "o": (h, hq * d), "gate_up": (2 * inter, h), "down": (h, inter),
            "logits": (vocab, h)}


def _pair(first, second, iters: int) -> tuple[float, float]:
    """Median milliseconds per call of each, over 5 alternating rounds of `iters` calls."""
    first(), second()
    rounds: tuple[list[float], list[float]] = ([], [])
    for _ in range(5):
        for fn, out in ((first, rounds[0]), (second, rounds[1])):
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            out.append((time.perf_counter() - t) / iters * 1e3)
    return statistics.median(rounds[0]), statistics.median(rounds[1])


def run(models=("tiny", "smollm2"), rows=ROWS, json_path: str | None = None) -> dict:
    if not available():
        raise SystemExit("this torch has no oneDNN (mkldnn) linear ops: nothing to compare")
    results = []
    print(f"float32, torch threads {torch.get_num_threads()}; ms per call (median), GFLOP/s, "
          "onednn/torch speedup")
    for model in models:
        for name, (out, inp) in projections(model).items():
            w = torch.randn(out, inp) / inp ** 0.5
            packed = PackedLinear(w, None)
            for m in rows:
                x = torch.randn(m, inp)
                iters = max(3, min(200, int(2e8 / (2 * m * out * inp))))
                ref, got = F.linear(x, w), packed(x)
                torch_ms, dnnl_ms = _pair(lambda x=x, w=w: F.linear(x, w), lambda x=x, p=packed: p(x), iters)
                gflop = 2 * m * out * inp / 1e9
                r = {"model": model, "weight": name, "out": out, "in": inp, "rows": m, "torch_ms": torch_ms,
                     "onednn_ms": dnnl_ms, "torch_gflops": gflop / torch_ms * 1e3,
                     "onednn_gflops": gflop / dnnl_ms * 1e3, "speedup": torch_ms / dnnl_ms,
                     "packed_by_default": out * inp >= MIN_PACKED_ELEMENTS,
                     "max_abs_diff": (ref - got).abs().max().item()}
                results.append(r)
                print(f"{model:8s} {name:8s} {out:6d}x{inp:<5d} rows {m:4d}: torch {torch_ms:8.3f} ms "
                      f"({r['torch_gflops']:5.1f})  onednn {dnnl_ms:8.3f} ms ({r['onednn_gflops']:5.1f})  "
                      f"x{r['speedup']:.2f}{'' if r['packed_by_default'] else '  (not packed by default)'}",
                      flush=True)
    packed_rows = [r["speedup"] for r in results if r["packed_by_default"]]
    summary = {"median_speedup_packed_weights": statistics.median(packed_rows) if packed_rows else None,
               "median_speedup_small_weights": statistics.median(
                   [r["speedup"] for r in results if not r["packed_by_default"]] or [float("nan")])}
    print(f"median speedup on weights packed by default: {summary['median_speedup_packed_weights']:.2f}x; "
          f"on smaller ones (left on F.linear): {summary['median_speedup_small_weights']:.2f}x")
    out = {"config": {"torch_threads": torch.get_num_threads(), "min_packed_elements": MIN_PACKED_ELEMENTS,
                      "rows": list(rows), "models": list(models)}, "summary": summary, "results": results}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    run()
