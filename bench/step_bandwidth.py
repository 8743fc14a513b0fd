"""Issue 27's bandwidth measure of a single-stream decode step: the weight bytes one step reads
over the step time, and that as a fraction of the memory copy bandwidth measured in the same run
(measure.machine). `bench weights` applies it to each of pdserve's weight formats, `bench engine` to
pdserve and to llama.cpp on the same GGUF file (`step_weight_bytes`: what llama.cpp's step reads).
"""

from __future__ import annotations


def step_weight_bytes(gguf_path: str) -> int:
    """Bytes of the matrices one llama.cpp decode step reads from this file: every tensor of two or
    more dimensions except the token embedding, which only gives a row per token unless the file
    has no `output.weight` and it doubles as the logits matrix (tied, as SmolLM2's)."""
    from model_files.gguf_reader import GGUFContents

    tensors = {t.name: t for t in GGUFContents(gguf_path).tensors if len(t.dims) >= 2}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(t.data.nbytes for t in tensors.values())


def bandwidth_use(weight_bytes: int, step_s: float | None, copy_gb_per_s: float | None) -> dict:
    """Weight bytes per decode step over the step time (GB/s), and that as a fraction of the copy
    bandwidth (None when either is unknown)."""
    gb_s = weight_bytes / step_s / 1e9 if step_s else None
    return {"weight_bytes_per_step": weight_bytes, "bytes_per_step_over_step_time_gb_s": gb_s,
            "fraction_of_copy_bandwidth": gb_s / copy_gb_per_s if gb_s and copy_gb_per_s else None}
