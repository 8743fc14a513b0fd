"""Build a model from a spec: "tiny" (weights drawn from a fixed seed), a Hugging Face
checkpoint directory (config.json + *.safetensors, sharded model.safetensors.index.json too), or
a Llama-family GGUF file: a path ending in .gguf, or a shipped name such as "smollm2" (model_files.gguf
dequantizes it to float32 tensors under Hugging Face names, which load through the same path).

`load_model(spec, device, dtype, backend) -> (model, config, tokenizer)`. The model runs in
float32 on CPU and bfloat16 on CUDA unless a dtype is given. Checkpoint tensors are read one at
a time with safetensors (never pickle) and copied into parameters allocated directly on the
target device; every parameter must be found and every checkpoint tensor must be used, else a
`CheckpointError` lists what is missing or unexpected.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator

import torch

from engine import weight_format
from engine.attention import AttentionBackend, get_backend
from engine.cpu_decode_layers import DecodeLayers
from engine.model import LlamaModel
from engine.model_config import ModelConfig
from kvcache.storage import dtype_from_name, dtype_name
from model_files.gguf import GGUFFile, is_gguf_spec, resolve_model_spec
from model_files.tokenizer import ByteTokenizer, HFTokenizer, gguf_tokenizer, load_tokenizer

log = logging.getLogger(__name__)
TINY_SEED = 1234
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded: files or tensors missing, extra or misshapen."""


def resolve_dtype(device: torch.device, dtype: str | torch.dtype | None) -> torch.dtype:
    """Requested dtype, or the default: float32 on CPU, bfloat16 on CUDA."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return dtype if isinstance(dtype, torch.dtype) else dtype_from_name(dtype)


def load_model(spec: str = "tiny", device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
               backend: AttentionBackend | str | None = None, cpu_gemm: bool = True, cpu_fused: bool = True,
               weights: str = "f32") -> tuple[LlamaModel, ModelConfig, ByteTokenizer | HFTokenizer]:
    """Returns (model in eval mode on `device`, its config with the dtype it runs in, tokenizer).

    backend: an AttentionBackend, a backend name ('torch', 'triton', 'auto') or None (auto).
    cpu_gemm: float32 on CPU, projections through oneDNN with packed weights (engine.cpu_gemm).
    cpu_fused: float32 on CPU, RMSNorm, rotary and SwiGLU through compiled kernels (engine.cpu_fused).
    weights: float32 on CPU, the matrices' storage format (engine.weight_format: f32, bf16, int8;
    gguf and gguf-q8 for a GGUF model only: its own Q4_1/Q8_0 blocks).
    """
    if weight_format.check_name(weights) in weight_format.GGUF_ACTS and not is_gguf_spec(spec):
        raise ValueError(f"--weights {weights} computes on a GGUF file's own blocks, and model {spec!r} is "
                         "not a GGUF file (a .gguf path or a shipped name such as smollm2); choose f32, "
                         "bf16 or int8")
    device = torch.device(device)
    run_dtype = resolve_dtype(device, dtype)
    blocks = None  # --weights gguf: the file's raw blocks by checkpoint_views name
    if not isinstance(backend, AttentionBackend):
        backend = get_backend(backend, device)
    if spec == "tiny":
        config = ModelConfig.tiny()
        model = LlamaModel(config, backend)
        _init_tiny(model, TINY_SEED)
        model.to(device=device, dtype=run_dtype)
        tokenizer = load_tokenizer(None, config)
    elif is_gguf_spec(spec):
        gguf_file = GGUFFile(resolve_model_spec(spec))
        config = ModelConfig.from_hf_config(gguf_file.hf_config())
        model = _empty_model(config, backend, device, run_dtype)
        load_weights(model, ((name, torch.from_numpy(array)) for name, array in gguf_file.tensors()),
                     label=os.path.basename(gguf_file.path))
        if weights in weight_format.GGUF_ACTS:
            tied = config.tie_word_embeddings
            blocks = {name: v for k, v in gguf_file.raw_blocks().items()
                      if (name := _param_name(k, tied)) is not None}
        tokenizer = gguf_tokenizer(gguf_file, config)
    else:
        directory = spec
        config = read_config(directory)
        model = _empty_model(config, backend, device, run_dtype)
        load_weights(model, directory)
        tokenizer = load_tokenizer(directory, config)
        if isinstance(tokenizer, ByteTokenizer):  # NOTE: said, not silent: text would be noise
            log.warning("%s has no tokenizer.json: text is encoded as bytes, which fits only a byte-level "
                        "model; copy the checkpoint's tokenizer.json into the folder", directory)
    model.eval().requires_grad_(False)
    weight_format.apply(model, weights, blocks)  # before packing: oneDNN packs the rounded weights
    model.pack_cpu_gemm(cpu_gemm)  # a no-op off CPU float32
    model.use_cpu_fused(cpu_fused)  # likewise
    model.decode_layers = DecodeLayers.build(model)  # GGUF blocks on CPU: decode steps' layers in C
    config = dataclasses.replace(config, dtype=dtype_name(run_dtype))
    return model, config, tokenizer


def _empty_model(config: ModelConfig, backend: AttentionBackend, device: torch.device,
                 run_dtype: torch.dtype) -> LlamaModel:
    """The model with uninitialised parameters, allocated once in the run dtype on `device`."""
    with torch.device("meta"), _initializers_skipped():
        model = LlamaModel(config, backend)
    model.to(dtype=run_dtype)  # still on meta: no memory touched yet
    model.to_empty(device=device)  # allocate once, in the run dtype, on the target device
    return model


@contextlib.contextmanager
def _initializers_skipped() -> Iterator[None]:
    """torch.nn.init's in-place initializers as no-ops while the model is built on meta: every
    parameter is overwritten from the checkpoint (or `_init_tiny`), and a meta tensor's `normal_`
    runs through torch._refs, whose first call imports torch._dynamo: 2.2 of a SmolLM2 engine's
    4.4 s of construction, in every worker process (2026-12-03, AMD EPYC Zen 3)."""
    names = [n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(torch.nn.init, n) for n in names}
    for n in names:
        setattr(torch.nn.init, n, _keep)
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch.nn.init, n, fn)


def _keep(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


def read_config(directory: str) -> ModelConfig:
    """ModelConfig from DIR/config.json, with EOS ids from generation_config.json merged in."""
    path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"model spec {directory!r} is neither 'tiny' nor a checkpoint directory")
    if not os.path.isfile(path):
        raise CheckpointError(f"{directory} has no config.json")
    with open(path) as f:
        config = ModelConfig.from_hf_config(json.load(f))
    gen_path = os.path.join(directory, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
        extra = eos if isinstance(eos, list) else [eos] if eos is not None else []
        merged = tuple(dict.fromkeys([*config.eos_token_ids, *(int(e) for e in extra)]))
        config = dataclasses.replace(config, eos_token_ids=merged)
    return config


def _init_tiny(model: LlamaModel, seed: int) -> None:
    """Deterministic random weights: norms 1, embeddings N(0, 0.1), linears N(0, 1/fan_in), biases 0."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.checkpoint_views().items():  # unfused registration order: fixed per config
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif name == "embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)


def checkpoint_files(directory: str) -> list[str]:
    """The safetensors files of a checkpoint: from the shard index when there is one."""
    index = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(directory, n) for n in names]
        absent = [n for n, p in zip(names, files) if not os.path.isfile(p)]
        if absent:
            raise CheckpointError(f"{INDEX_FILE} names shard files that are absent: {absent}")
        return files
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {directory} "
                              "(pickled .bin weights are not loaded)")
    return files


def _param_name(key: str, tied: bool) -> str | None:
    """Our name for a checkpoint key (a key of `LlamaModel.checkpoint_views`: fused q/k/v and
    gate/up weights are filled slice by slice as their parts arrive); None for keys skipped."""
    if key.endswith("rotary_emb.inv_freq"):  # old checkpoints saved the RoPE buffer
        return None
    if key == "lm_head.weight":
        return None if tied else key
    return key[len("model."):] if key.startswith("model.") else key


def _safetensors_tensors(directory: str) -> Iterator[tuple[str, Callable[[], torch.Tensor], str]]:
    """(key, tensor reader, file name) for every tensor of a safetensors checkpoint; a tensor is
    read only when its reader is called."""
    from safetensors import safe_open

    for path in checkpoint_files(directory):
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                yield key, (lambda f=f, key=key: f.get_tensor(key)), os.path.basename(path)


def load_weights(model: LlamaModel, source: str | Iterable[tuple[str, torch.Tensor]],
                 label: str | None = None) -> None:
    """Copy every checkpoint tensor into its parameter (converting dtype/device).

    source: a checkpoint directory (safetensors), or (Hugging Face name, tensor) pairs such as a
    GGUF file's (model_files.gguf); label: what errors call a pair source (default 'tensors').
    """
    if isinstance(source, str):
        tensors, label = _safetensors_tensors(source), source
    else:
        label = label or "tensors"
        tensors = ((key, (lambda t=t: t), label) for key, t in source)
    params = model.checkpoint_views()  # fused weights are built here, one row slice per tensor
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for key, read, where in tensors:
            name = _param_name(key, model.config.tie_word_embeddings)
            if name is None:
                continue
            if name not in params:
                unexpected.append(key)
                continue
            tensor = read()
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise CheckpointError(f"{key} in {where} has shape {tuple(tensor.shape)}, "
                                      f"the model expects {tuple(params[name].shape)}")
            params[name].copy_(tensor)
            loaded.add(name)
    missing = sorted(n if n == "lm_head.weight" else f"model.{n}" for n in set(params) - loaded)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {label} does not match {model.config.architecture}: "
                              f"missing {_few(missing)}; unexpected {_few(unexpected)}")


def _few(names: list[str], n: int = 5) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more
