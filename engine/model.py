"""The Llama-family decoder (Llama, Mistral, Qwen2) in plain torch over the paged KV cache.

One `forward` runs a packed (varlen) batch: T new tokens of S sequences back to back, described
by an AttentionMetadata. Each layer projects q, k and v with one fused matmul, rotates q and k
together from the step's cos/sin rows, and hands them to the attention backend, which writes the
new K/V into their slots of the KVStorage and attends through the block tables. The MLP's gate
and up projections are one fused matmul too. Given the rows the caller wants, the last layer
stores every row's K/V but attends, projects and runs its MLP for those rows only. Numerics
follow transformers' implementation (RMSNorm in float32, rotate-half RoPE, SwiGLU) so a
checkpoint gives the same logits here as there. `checkpoint_views` names every parameter (fused
ones as row slices) by its checkpoint key without the leading "model."; engine.loader copies
checkpoint tensors into those views. Logits come out in float32. On CPU in float32 each
projection big enough to pay runs through oneDNN on its weight packed once (`pack_cpu_gemm`,
engine.cpu_gemm); the others, and every other device or dtype, through F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_fused
from engine.attention import AttentionBackend
from engine.attn_metadata import AttentionMetadata, int64_tensor
from engine.cpu_gemm import MIN_PACKED_ELEMENTS, PackedLinear, Projection, pack
from engine.model_config import ModelConfig
from engine.rope import RotaryEmbedding, apply_rotary
from kvcache.storage import KVStorage


def logits_indices(meta: AttentionMetadata) -> torch.Tensor:
    """(S,) int64 row of each sequence's last new token in the packed batch."""
    return meta.query_start_loc[1:].long() - 1


class RMSNorm(nn.Module):
    fused = False  # float32 on CPU through engine.cpu_fused (LlamaModel.use_cpu_fused)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return cpu_fused.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # transformers: normalise in float32, round to the input dtype, then scale
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, its norm), both (T, hidden); the fused path adds into `residual` in place."""
        if self.fused:
            return residual, cpu_fused.rms_norm(x, self.weight, self.eps, residual)
        residual = residual + x
        return residual, self.forward(residual)


class Attention(nn.Module):
    """Grouped-query self-attention; K/V go through the paged cache of one layer."""

    fused = False  # rotary in place through engine.cpu_fused

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int):
        super().__init__()
        c = config
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.head_dim ** -0.5
        self.backend = backend
        self.qkv_proj = Projection(c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim,
                                   bias=c.attention_bias)  # rows: q, then k, then v
        self.o_proj = Projection(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_proj_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata,
                keep: list[int] | None = None) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden), or (len(keep), hidden) for the rows in `keep` only (every
        row's K/V is stored either way)."""
        T = x.shape[0]
        Hq, Hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj.forward(x).view(T, Hq + 2 * Hkv, self.head_dim)
        # qkv: (T, Hq + 2 Hkv, D); q and k rotated at once -> qk (T, Hq + Hkv, D)
        qk = cpu_fused.rotary_(qkv[:, :Hq + Hkv], cos, sin) if self.fused else \
            apply_rotary(qkv[:, :Hq + Hkv], cos, sin)
        if keep is None:
            o = self.backend.forward(qk[:, :Hq], qk[:, Hq:], qkv[:, Hq + Hkv:], k_cache, v_cache, meta,
                                     self.scale, self.layer)  # (T, Hq, D)
        else:
            o = self.backend.forward(qk[:, :Hq], qk[:, Hq:], qkv[:, Hq + Hkv:], k_cache, v_cache, meta,
                                     self.scale, self.layer, keep)  # (R, Hq, D)
        o = o.reshape(o.shape[0], Hq * self.head_dim)  # (T or R, Hq D)
        return self.o_proj.forward(o)  # (T or R, hidden)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up as one matmul."""

    fused = False  # silu(gate) * up through engine.cpu_fused

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.intermediate_size = c.intermediate_size
        self.gate_up_proj = Projection(c.hidden_size, 2 * c.intermediate_size, bias=c.mlp_bias)  # gate, up
        self.down_proj = Projection(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inter = self.intermediate_size
        gate_up = self.gate_up_proj.forward(x)  # (T, 2 I)
        if self.fused:
            return self.down_proj.forward(cpu_fused.silu_mul(gate_up))  # (T, hidden)
        gate = F.silu(gate_up[:, :inter])  # (T, I)
        return self.down_proj.forward(gate.mul_(gate_up[:, inter:]))  # (T, hidden)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, backend, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata,
                keep: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
        """h (T, hidden) -> (T, hidden); keep = (rows, the same as an int64 index): past the
        attention only those rows go on -> (R, hidden)."""
        # .forward directly: the hot path skips nn.Module.__call__ (no hooks are ever registered)
        x = self.input_layernorm.forward(h)
        if keep is None:
            a = self.self_attn.forward(x, cos, sin, k_cache, v_cache, meta)  # (T, hidden)
        else:
            a = self.self_attn.forward(x, cos, sin, k_cache, v_cache, meta, keep[0])  # (R, hidden)
            h = h.index_select(0, keep[1])
        h, x = self.post_attention_layernorm.add_forward(a, h)  # h + a, and its norm
        return h + self.mlp.forward(x)


class LlamaModel(nn.Module):
    """Decoder stack plus output projection.

    Parameters: embed_tokens, layers.{i}.*, norm, and lm_head unless the embeddings are tied
    (then `lm_head` is None and compute_logits uses embed_tokens.weight). Construct, then move
    with `.to(device, dtype)`; inference only (call under torch.inference_mode()).
    """

    def __init__(self, config: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.config = config
        self.backend = backend
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, backend, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        self.lm_head = (None if config.tie_word_embeddings
                        else Projection(config.hidden_size, config.vocab_size, bias=False))
        self.logits_packed: PackedLinear | None = None  # set by pack_cpu_gemm
        self.logits_lowp = None  # engine.cpu_lowp.LowpLinear for a few rows, set by engine.weight_format
        self.decode_layers = None  # engine.cpu_decode_layers.DecodeLayers: decode steps' layers in C

    def checkpoint_views(self) -> dict[str, torch.Tensor]:
        """Every parameter under its checkpoint key (without "model."), in the order an unfused
        model registers them: fused q/k/v and gate/up appear as their row slices (views, so
        copying into one fills the fused parameter)."""
        c = self.config
        parts = {"qkv_proj": (("q_proj", c.num_heads * c.head_dim), ("k_proj", c.num_kv_heads * c.head_dim),
                              ("v_proj", c.num_kv_heads * c.head_dim)),
                 "gate_up_proj": (("gate_proj", c.intermediate_size), ("up_proj", c.intermediate_size))}
        views: dict[str, torch.Tensor] = {}
        for name, module in self.named_modules():
            leaf = name.rpartition(".")[2]
            if leaf in parts:
                base, start = name.rpartition(".")[0], 0
                for part, rows in parts[leaf]:
                    for kind in ("weight", "bias"):
                        param = getattr(module, kind)
                        if param is not None:
                            views[f"{base}.{part}.{kind}"] = param[start:start + rows]
                    start += rows
            else:
                for kind, param in module.named_parameters(recurse=False):
                    views[f"{name}.{kind}" if name else kind] = param
        return views

    def _check(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVStorage) -> None:
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids and positions must both be (T,), got {tuple(input_ids.shape)} "
                             f"and {tuple(positions.shape)}")
        if input_ids.dtype != torch.long or positions.dtype != torch.long:
            raise ValueError("input_ids and positions must be int64 tensors")
        lay, c = kv.layout, self.config
        if (lay.num_layers, lay.num_kv_heads, lay.head_dim) != (c.num_layers, c.num_kv_heads, c.head_dim):
            raise ValueError(f"KV layout {lay.num_layers} layers x {lay.num_kv_heads} heads x {lay.head_dim} "
                             f"does not fit the model ({c.num_layers} x {c.num_kv_heads} x {c.head_dim})")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVStorage,
                meta: AttentionMetadata, rows: list[int] | None = None) -> torch.Tensor:
        """input_ids, positions: (T,) int64 on the model's device -> hidden (T, hidden) in the
        model dtype. New K/V are written into `kv` at meta.slot_mapping. rows: the only rows the
        caller wants, ascending, each the last new token of its sequence (None: all) -> (R, hidden):
        the last layer attends, projects and runs its MLP for those rows only (a prefill chunk
        that does not end its prompt needs nothing past its last layer's K/V)."""
        self._check(input_ids, positions, kv)
        h = self.embed_tokens(input_ids)  # (T, hidden)
        cos, sin = self.rotary.tables(positions, h.dtype, meta.max_seq_len - 1)  # (T, D) each
        if self.decode_layers is not None and (rows is None or len(rows) == len(input_ids)) \
                and self.decode_layers.run(h, cos, sin, kv, meta):  # a decode step, its layers in C
            return self.norm.forward(h)
        cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, D): every head of a row alike
        keep = None if rows is None else (rows, int64_tensor(rows, h.device))
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv.layer_view(i)  # (N, B, Hkv, D) each
            h = layer.forward(h, cos, sin, k_cache, v_cache, meta, keep if i == last else None)
        return self.norm.forward(h)  # (T or R, hidden)

    def pack_cpu_gemm(self, enabled: bool = True, min_elements: int = MIN_PACKED_ELEMENTS) -> None:
        """Route every projection and the logits through oneDNN with packed weights (engine.cpu_gemm)
        where that applies (float32 on CPU), or back to F.linear (not enabled). Call after the
        weights are loaded and the model moved: packing copies the weights as they are.
        min_elements: weights smaller than this stay on F.linear (oneDNN's call costs more)."""
        for module in self.modules():
            if isinstance(module, Projection):
                module.pack_cpu(enabled, min_elements)
        if self.lm_head is not None:
            self.logits_packed = self.lm_head.packed
        else:  # tied: the logits reuse the embedding matrix, packed for them
            self.logits_packed = pack(self.embed_tokens.weight, None, min_elements) if enabled else None

    def use_cpu_fused(self, enabled: bool = True) -> bool:
        """Run RMSNorm, rotary and SwiGLU through engine.cpu_fused where that applies (enabled, the
        kernels built, float32 weights on CPU), else through torch. Returns whether it applies."""
        on = enabled and self.embed_tokens.weight.dtype == torch.float32 and \
            self.embed_tokens.weight.device.type == "cpu" and cpu_fused.available()
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.fused = on
        return on

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., hidden) -> logits (..., vocab) in float32."""
        lowp = self.logits_lowp
        if lowp is not None and hidden.dim() == 2 and hidden.shape[0] <= lowp.max_rows:
            return lowp(hidden)  # (S, vocab)
        if self.logits_packed is not None:
            return self.logits_packed(hidden)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
