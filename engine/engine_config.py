"""The engine's configuration (`EngineConfig`: one frozen dataclass, each field documented where
it is declared) and what `LLMEngine.generate` returns (`Completion`). Kept apart from
engine.engine so the step loop stays one file's job; engine.engine re-exports both."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine import weight_format
from engine.scheduler import SchedulerConfig

ROLES = ("colocated", "prefill", "decode")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"              # 'tiny' or a Hugging Face checkpoint directory
    device: str = "cpu"              # 'cpu' or 'cuda[:i]'
    dtype: str | None = None         # None picks float32 on CPU, bfloat16 on CUDA
    block_size: int = 16             # token slots per KV block
    num_blocks: int = 512            # device pool size in blocks
    num_host_blocks: int = 256       # host swap pool in blocks (0 disables swap preemption)
    enable_prefix_caching: bool = True  # reuse full blocks of prompts seen before
    attention_backend: str = "auto"  # 'auto', 'torch' or 'triton'
    cpu_kernels: bool = True         # CPU float32: compiled C decode attention (pool read in place) and
                                     # elementwise steps (engine.cpu_kernels; torch paths without a compiler)
    decode_mirror: bool = True       # torch backend without that kernel: decode reads a per-slot K/V buffer
    cpu_gemm: bool = True            # CPU float32: matmuls via oneDNN, weights packed once (a 2nd copy)
    weights: str = "f32"             # CPU float32: matrices stored 'f32', 'bf16', 'int8' (per-row scale) or
                                     # 'gguf' (a GGUF model's own Q4_1/Q8_0 blocks; 'gguf-q8': with x
                                     # rounded to int8 blocks); decode rows read those bytes
                                     # (engine.weight_format)
    cuda_graphs: int = 64            # CUDA, Triton backend: decode steps of up to this many sequences replay
                                     # CUDA graphs captured per batch bucket (engine.cuda_graphs); 0: eager
    kv_shm: bool = False             # CPU pool in a /dev/shm file that same-node peers read (Ray prefill)
    role: str = "colocated"          # 'colocated', 'prefill' or 'decode'
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)  # batching limits

    def __post_init__(self) -> None:
        if isinstance(self.scheduler, dict):  # from a worker's config dict (YAML, ClusterConfig.engine)
            object.__setattr__(self, "scheduler", SchedulerConfig(**self.scheduler))
        weight_format.check_name(self.weights)
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")


@dataclass
class Completion:
    """A finished request as `generate` returns it (the HTTP body's `choices`)."""

    request_id: str
    prompt_ids: list[int]
    choices: list[dict]
