"""Model identity: a short hash that tells whether two engines run the same model.

It covers the model config (every field) and each weight's name, shape and dtype, plus a
sample of each weight's bytes (its first 4 KiB), so two fine-tunes of one architecture differ
too, and the rounding of activations a weight format adds (`gguf-q8`: the same weights, another
function of them). It is computed once at load and travels in the KV layout fingerprint: workers whose
identities differ are refused at the start-up handshake and never exchange KV blocks.
"""

from __future__ import annotations

import dataclasses
import json

import torch
import xxhash

SAMPLE_BYTES = 4096


def model_identity(config, model: torch.nn.Module) -> str:
    """16 hex digits identifying (config, weights) of a loaded model."""
    h = xxhash.xxh3_128()
    h.update(json.dumps(dataclasses.asdict(config), sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        h.update(f"|{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        flat = tensor.detach().reshape(-1)
        count = max(1, SAMPLE_BYTES // max(1, flat.element_size()))
        h.update(flat[:count].to(device="cpu", dtype=torch.float32).numpy().tobytes())
    linears = [getattr(m, "lowp", None) for m in model.modules()] + [getattr(model, "logits_lowp", None)]
    acts = sorted({getattr(lin, "act", "f32") for lin in linears} - {"f32"})
    if acts:  # engine.cpu_gguf.GgufLinear with x rounded to int8 blocks
        h.update(f"|activations {','.join(acts)}|".encode())
    return h.hexdigest()[:16]
