"""Model configuration: one frozen dataclass describing a Llama-family decoder.

`ModelConfig.tiny()` is the default built-in model (weights drawn from a fixed seed by the
loader); `ModelConfig.from_hf_config(dict)` reads a Hugging Face `config.json` for the three
architectures this engine runs (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM) and
refuses every other one with `UnsupportedModelError` naming it. `kv_layout` derives the paged
KV pool layout (kvcache.KVLayout) the model's attention layers need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache.storage import KVLayout, dtype_from_name, dtype_name

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# config.json's model_type -> its architecture, for a config without `architectures` (some exports
# and hand-written configs omit it; transformers itself maps model_type the same way)
ARCHITECTURE_OF_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                              "qwen2": "Qwen2ForCausalLM"}
# rope_type values engine.rope implements (see engine/rope.py for the formulas).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """A checkpoint this engine cannot run exactly (architecture, activation, rope type...)."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    vocab_size: rows of the embedding and of the output projection.
    hidden_size: residual stream width.
    intermediate_size: SwiGLU MLP inner width.
    num_layers: decoder layers.
    num_heads: query heads per layer.
    num_kv_heads: key/value heads per layer (grouped-query attention; divides num_heads).
    head_dim: channels per head (need not equal hidden_size / num_heads, e.g. Mistral-Nemo).
    rope_theta: rotary base frequency.
    rms_norm_eps: epsilon inside every RMSNorm.
    max_position_embeddings: longest context (prompt + generated) the model accepts. For a
        checkpoint with a sliding attention window this is capped at the window, because the
        attention here is full attention and is exact only up to the window.
    tie_word_embeddings: the output projection reuses the input embedding matrix.
    attention_bias: q/k/v projections carry a bias (Qwen2 always; Llama when attention_bias).
    o_proj_bias: the attention output projection carries a bias (Llama with attention_bias).
    mlp_bias: the gate/up/down projections carry a bias (Llama with mlp_bias).
    architecture: the Hugging Face architecture name (`LlamaForCausalLM`, ...).
    bos_token_id: begin-of-sequence id, or None when the model has none.
    eos_token_ids: every id that ends generation (Llama 3 lists several); may be empty.
    dtype: name of the dtype the weights are held in: 'float32', 'float16' or 'bfloat16'.
        From a checkpoint this is the dtype it was saved in; the loader returns a copy with the
        dtype it actually runs in.
    rope_scaling: HF rope scaling parameters as sorted (key, value) pairs, () for none; the
        pair ('rope_type', ...) names the variant (engine.rope implements default, linear, llama3).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    rope_scaling: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(f"unsupported architecture {self.architecture!r}; "
                                        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        dtype_from_name(self.dtype)
        for tok in (self.bos_token_id, *self.eos_token_ids):
            if tok is not None and not 0 <= tok < self.vocab_size:
                raise ValueError(f"special token id {tok} outside the vocabulary 0..{self.vocab_size - 1}")

    # ---- derived ------------------------------------------------------------------------
    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence id, or None."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def rope_scaling_dict(self) -> dict:
        return dict(self.rope_scaling)

    def kv_layout(self, block_size: int, dtype: str | torch.dtype | None = None,
                  model_id: str = "") -> KVLayout:
        """The KV pool layout this model needs, with `block_size` slots per block.

        dtype: the KV element type (name or torch dtype); defaults to the model's dtype.
        model_id: the loaded model's identity (`engine.identity.model_identity`).
        """
        if dtype is None:
            dtype = self.dtype
        elif isinstance(dtype, torch.dtype):
            dtype = dtype_name(dtype)
        return KVLayout(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                        block_size=block_size, dtype=dtype, model=model_id)

    # ---- constructors -------------------------------------------------------------------
    @staticmethod
    def tiny() -> ModelConfig:
        """The built-in test model: byte-level vocabulary (ids 0..255 = bytes, 256 = BOS,
        257 = EOS, the rest unused), 4 layers of 4 query / 2 KV heads of 32 channels."""
        return ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=352, num_layers=4, num_heads=4,
                           num_kv_heads=2, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-6,
                           max_position_embeddings=2048, tie_word_embeddings=True,
                           architecture="LlamaForCausalLM", bos_token_id=256, eos_token_ids=(257,),
                           dtype="float32")

    @staticmethod
    def from_hf_config(cfg: dict) -> ModelConfig:
        """Read a Hugging Face config.json dict; refuse what this engine cannot run exactly. Without
        `architectures`, a supported `model_type` names it (ARCHITECTURE_OF_MODEL_TYPE)."""
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        arch = archs[0] if archs else ARCHITECTURE_OF_MODEL_TYPE.get(model_type)
        if arch is None:
            raise UnsupportedModelError(f"config.json names no architectures and its model_type "
                                        f"{model_type!r} is not one this engine runs "
                                        f"({', '.join(ARCHITECTURE_OF_MODEL_TYPE)})")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(f"unsupported architecture {arch}; this engine runs "
                                        f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{arch} with hidden_act={act!r} is unsupported (SwiGLU needs silu)")
        heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // heads
        rope_theta, scaling = _rope_params(cfg, arch)
        if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
            raise UnsupportedModelError(f"{arch} with partial_rotary_factor is unsupported")
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        window = cfg.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
            window = None
        if window:
            max_pos = min(max_pos, int(window))
        attn_bias = bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        if dtype not in ("float32", "float16", "bfloat16"):
            dtype = "float32"
        bos = cfg.get("bos_token_id")
        return ModelConfig(
            vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rope_theta=float(rope_theta), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "Qwen2ForCausalLM" else attn_bias,
            o_proj_bias=attn_bias if arch == "LlamaForCausalLM" else False,
            mlp_bias=bool(cfg.get("mlp_bias", False)) if arch == "LlamaForCausalLM" else False,
            architecture=arch, bos_token_id=int(bos) if bos is not None else None, eos_token_ids=eos_ids,
            dtype=dtype, rope_scaling=tuple(sorted(scaling.items())))


def _rope_params(cfg: dict, arch: str) -> tuple[float, dict]:
    """(rope_theta, scaling dict incl. 'rope_type') from either the transformers 5
    `rope_parameters` form or the older `rope_theta` + `rope_scaling` form."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = dict(cfg.get("rope_scaling") or {})
    theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = {**legacy, **params}
    if "type" in scaling:  # pre-4.45 spelling
        scaling.setdefault("rope_type", scaling.pop("type"))
    scaling.setdefault("rope_type", "default")
    if scaling["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"{arch} with rope_type {scaling['rope_type']!r} is unsupported; "
                                    f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if scaling["rope_type"] != "default" and "original_max_position_embeddings" not in scaling:
        scaling["original_max_position_embeddings"] = int(cfg.get("max_position_embeddings", 2048))
    return float(theta), scaling
